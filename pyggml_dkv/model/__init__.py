"""What a DFlash drafter is: its configuration, its parameters, the files they live in, and
their upload to a ggml backend. No computation happens here (the reference and the drafter
layers compute with it).
"""
