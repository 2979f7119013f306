"""The fuzzer of every Redis key and channel queueserve reads, and of the worker's metrics port
(tests/faults/test_fuzz.py): ``surfaces`` registers what to attack and how, ``values`` makes
the hostile values, ``app`` holds the servings its worker process runs."""
