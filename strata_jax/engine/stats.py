"""What the engine did, in numbers people read: per request and since start, the speed, the verify windows'
drafts, and where the experts ran."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class ExpertStats:
    """Where the experts of the windows ran (offload on): (token, expert) entries and distinct experts per layer
    and window, summed over layers and windows."""
    entries: int = 0
    entries_resident: int = 0
    entries_fetched: int = 0
    entries_cpu: int = 0
    distinct: int = 0
    distinct_resident: int = 0
    distinct_fetched: int = 0
    distinct_cpu: int = 0
    # The routing approximations (strata_jax/offload/approx.py)
    distinct_skipped: int = 0  # tail skip: missed experts neither copied nor computed
    entries_skipped: int = 0
    prior_tokens: int = 0  # route prior: decode tokens routed with it
    prior_tokens_changed: int = 0  # ... whose top-K set it changed
    prior_entries: int = 0  # their (token, expert) entries
    prior_hits_unbiased: int = 0  # entries on a resident expert without the prior
    prior_hits: int = 0  # ... with it
    swaps: int = 0  # resident swap: missed experts swapped for resident ones
    prefetched: int = 0  # prefetch=N: experts copied into slots on the previous layer's prediction
    prefetch_used: int = 0  # ... that a window then read (counted among the resident hits)
    pcie_bytes: int = 0
    pool_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        """Share of the distinct experts the windows needed that were already in a device slot."""
        return self.distinct_resident / self.distinct if self.distinct else 0.0

    def approx_lines(self, approx) -> list[str]:
        """One line per routing approximation that is on (counts since the engine started when self is the total)."""
        lines = []
        if approx.tail_skip:
            lines.append(f"route tail skip: {self.distinct_skipped} missed experts skipped "
                         f"({self.entries_skipped} entries) since the start")
        if approx.prior is not None:
            entries = self.prior_entries
            with_, without = (self.prior_hits / entries, self.prior_hits_unbiased / entries) if entries else (0.0, 0.0)
            lines.append(f"route prior: {self.prior_tokens_changed} of {self.prior_tokens} token routings changed "
                         f"their top-K; entry hit rate {with_:.1%} with the prior, {without:.1%} without, "
                         "since the start")
        if approx.resident:
            lines.append(f"route resident swap: {self.swaps} swaps since the start")
        return lines

    def __iadd__(self, other: "ExpertStats") -> "ExpertStats":
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def summary(self) -> str:
        return (f"hit rate {self.hit_rate:.1%}; distinct experts resident/fetched/cpu "
                f"{self.distinct_resident}/{self.distinct_fetched}/{self.distinct_cpu}, entries "
                f"{self.entries_resident}/{self.entries_fetched}/{self.entries_cpu}; "
                + (f"prefetched {self.prefetched}, {self.prefetch_used} of them used; " if self.prefetched else "")
                + f"PCIe {self.pcie_bytes / 2**20:.1f} MiB; host pool {self.pool_s * 1e3:.1f} ms")


@dataclasses.dataclass
class RequestStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV rows the last request left (prefix reuse): not prefilled
    prefill_s: float = 0.0
    generated_tokens: int = 0
    decode_s: float = 0.0
    windows: int = 0  # decode windows run (graph calls after the prefill)
    window_tokens: int = 0  # tokens those windows ran (the last accepted one + drafts)
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    draft_pauses: int = 0  # rejected verify windows after which the n-gram drafter paused (drafts.DraftGate)
    # A sampled request's n-gram drafts checked against the next token instead of run (DraftGate.shadow), and hits
    shadow_drafts: int = 0
    shadow_hits: int = 0
    # Verify windows: host time from one window's result to the next window's dispatch (the device idles then;
    # the T=1 loop without drafts queues the next window before it reads, so it has no such gap).
    host_gap_s: float = 0.0
    host_gaps: int = 0
    # Slots filled from the prompt's prefill (static policy, lru with pcie_frac 0): experts copied, and the time until
    # they were on the device (waited for: neither the prefill's nor the decode's)
    slot_fill_experts: int = 0
    slot_fill_s: float = 0.0
    # slot_refresh: the refreshes during the decode, the experts they copied and their time (part of decode_s)
    slot_refreshes: int = 0
    slot_refresh_experts: int = 0
    slot_refresh_s: float = 0.0
    prefill_experts: ExpertStats = dataclasses.field(default_factory=ExpertStats)
    decode_experts: ExpertStats = dataclasses.field(default_factory=ExpertStats)

    @property
    def prefill_tok_s(self) -> float:
        return (self.prompt_tokens - self.cached_tokens) / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        # The first generated token comes out of the prefill; the decode rate counts the ones after it.
        n = max(self.generated_tokens - 1, 0)
        return n / self.decode_s if self.decode_s > 0 else 0.0

    def __iadd__(self, other: "RequestStats") -> "RequestStats":
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            value += getattr(other, f.name)  # numbers, and ExpertStats in place
            setattr(self, f.name, value)
        return self

    @property
    def mean_accepted(self) -> float:
        """Drafts accepted per decode window."""
        return self.drafts_accepted / self.windows if self.windows else 0.0

    @property
    def mean_window(self) -> float:
        """Tokens per decode window (1 + drafts)."""
        return self.window_tokens / self.windows if self.windows else 0.0

    def summary(self) -> str:
        cached = f" ({self.cached_tokens} reused)" if self.cached_tokens else ""
        fill = (f", slots filled from the prefill: {self.slot_fill_experts} experts copied in "
                f"{self.slot_fill_s * 1e3:.1f} ms" if self.slot_fill_s else "")
        fill += (f"; {self.slot_refreshes} slot refreshes copied {self.slot_refresh_experts} experts in "
                 f"{self.slot_refresh_s * 1e3:.1f} ms of the decode" if self.slot_refreshes else "")
        return (f"prompt tokens: {self.prompt_tokens}{cached}, prefill: {self.prefill_tok_s:.1f} tok/s{fill}, "
                f"generated tokens: {self.generated_tokens}, decode: {self.decode_tok_s:.1f} tok/s")

    def draft_summary(self) -> str:
        rate = self.drafts_accepted / self.drafts_proposed if self.drafts_proposed else 0.0
        gap = (f"; host time between windows {self.host_gap_s / self.host_gaps * 1e3:.2f} ms (mean of "
               f"{self.host_gaps})" if self.host_gaps else "")
        pauses = f", paused {self.draft_pauses} times after a rejected window" if self.draft_pauses else ""
        if self.shadow_drafts:
            pauses += f", {self.shadow_hits}/{self.shadow_drafts} shadow drafts right"
        return (f"drafts: proposed {self.drafts_proposed}, accepted {self.drafts_accepted} ({rate:.0%}){pauses}; "
                f"{self.windows} windows, mean accepted per window {self.mean_accepted:.2f}, "
                f"mean window size {self.mean_window:.2f}{gap}")


@dataclasses.dataclass
class Stats:
    """What the engine did: the last request, and every request since start summed."""
    last: RequestStats = dataclasses.field(default_factory=RequestStats)
    total: RequestStats = dataclasses.field(default_factory=RequestStats)
    requests: int = 0
    compile_s: float = 0.0
    batch: list[RequestStats] = dataclasses.field(default_factory=list)  # the last generate_batch's, per prompt
    batch_windows: int = 0  # batched windows run (generate_batch, BatchSession)
    batch_rows_max: int = 0  # the most live sequences one batched window ran
    batch_reused_tokens: int = 0  # prompt tokens whose rows a freed KV slot kept (prefix reuse across requests)

    def add(self, r: RequestStats) -> None:
        self.last = r
        self.requests += 1
        self.total += r
