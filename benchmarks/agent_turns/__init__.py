"""benchmarks/agent_turns_bench.py in parts: workload, arms, worker (one run), stats, report."""
