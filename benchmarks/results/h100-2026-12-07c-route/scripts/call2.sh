# Call 2: call 1's steps with the rank form of the kernel (select_by_rank: every expert ranked at once up to 128
# experts, four reductions; call 1 ran K rounds of select, 3.3 us a launch; the rank form is gone from the code since).
CALL=c2 TESTS=route exec bash "$(dirname "$0")/call1.sh"
