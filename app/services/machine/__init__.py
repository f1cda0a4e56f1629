"""What the box is: GPUs (NVML), processes (/proc), host load, GPU history, the simulated
machine. No knowledge of jobs."""
