"""What every benchmark script shares: its RESULTS.md section, the machine it ran on, clocks
and medians, the chat workload, and the servers it starts as subprocesses."""
