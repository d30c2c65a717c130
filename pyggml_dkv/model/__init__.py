"""What a DFlash drafter is: its configuration, its parameters and the files they live in. No
computation happens here (the reference and the drafter layers compute with it), and every module
imports without the compiled ggml extension (tests/test_layering.py); the upload to a ggml backend
is the drafter layer's (`pyggml_dkv.drafter.backend_weights`).
"""
