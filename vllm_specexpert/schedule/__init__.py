"""The vLLM scheduler adapter: the token scheduler (ExpertFlow §3.3), which runs decode
sequences in groups whose predicted routes overlap most."""
