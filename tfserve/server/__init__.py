"""A serving process as `tfserve serve` starts it: the entry point (`main`) and several
processes on one port (`worker_processes`)."""
