"""Renderers: the kernel language (poot/kernels/lang.py) turned into target code, one module per
target. They produce text or words and never touch a driver."""
