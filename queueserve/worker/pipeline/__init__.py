"""One serving inside one partition, step by step: intake (read, reclaim), decode
(admission), batching (assemble), execute, replies. Internal."""
