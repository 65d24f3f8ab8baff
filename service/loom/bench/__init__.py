"""`loom bench`: the workloads of WORKLOADS.md, run for Loom and a peer side by side in one run."""
