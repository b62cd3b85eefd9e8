"""The cost model: hardware profiles, compute, communication and memory, in seconds and bytes."""
