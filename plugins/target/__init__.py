"""The target's compiled CPU kernels (``cpu.py``): the reference runtime's MoE and attention in one call each."""
