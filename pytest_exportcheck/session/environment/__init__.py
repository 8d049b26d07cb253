"""What a run sets up around its items: TF32 off (``_float32``), the golden store
(``_golden_setup``), the signing key (``_signing_key``), the user's model directories
(``_model_dirs``), the suite's extra requirements (``_requirements``) and scratch
directories (``_scratch``).
"""
