"""Support code only the tests and benchmarks use; not part of the wheel.

stream.py   a steady multi-lane HL7 stream through the lab, and the verdict on its deliveries
staging.py  staging one inbound message, the shortcut store tests seed rows with
memory.py   the proportional set size (PSS) of a process tree, per component (bench/stack_memory.py)
"""
