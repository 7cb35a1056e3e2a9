"""The one model architecture the end-to-end tests serve, as an SGLang
external model package (``SGLANG_EXTERNAL_MODEL_PACKAGE=kvt_sglang_models``):
SGLang's own Llama, registered alone, so a server start does not import
every model module SGLang ships (most of which fail on a CPU-only host
anyway). The servers' startup time halves; the model code is unchanged."""
