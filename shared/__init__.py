"""Code shared by every process: wire protocol, sampling parameters, configs."""
