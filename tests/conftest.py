import os
import sys
from pathlib import Path

# Engine tests run vLLM's CPU build on a small machine.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Lets tests inspect worker-side modules with LLM.apply_model.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

sys.path.insert(0, str(Path(__file__).parent))
