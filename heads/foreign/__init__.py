"""Heads in other projects' formats: their modules (`modules`), reading their folders (`read`),
converting them to ours (`convert`) and writing ours in the layouts vLLM and SGLang load (`export`)."""
