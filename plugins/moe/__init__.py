"""The target's MoE as a compiled CPU kernel (``cpu.py``): the reference runtime's routed experts in one call."""
