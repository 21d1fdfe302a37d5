"""r2ccl as SGLang's tensor-parallel communicator, through SGLang's own plugin mechanism (the
`sglang.srt.plugins` entry point and its HookRegistry; no change to SGLang's files). Follows
SGLang 0.5.23; tests/python/test_sglang.py checks the hooked methods against that version."""

SGLANG_VERSION = "0.5.23"
