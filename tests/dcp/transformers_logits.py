"""Opens an hp Hugging Face export with transformers and compares its logits with hp's.

    python3 transformers_logits.py DIR

DIR holds the export (config.json, model.safetensors) and, from tests/dcp/hf_transformers_test.cpp,
hp_tokens.bin (int64 tokens) and hp_logits.bin (hp's fp32 logits for them, [tokens, vocab]). The model
must load as LlamaForCausalLM; its logits must be within 1e-4 of the largest logit in fp32, and within
3e-2 once the model is cast to bf16. Exits 1 when one is not.
"""
import sys

import torch
import transformers


def read(path, dtype):
    with open(path, "rb") as f:
        return torch.frombuffer(bytearray(f.read()), dtype=dtype)


def main(folder):
    tokens = read(f"{folder}/hp_tokens.bin", torch.int64).unsqueeze(0)
    ours = read(f"{folder}/hp_logits.bin", torch.float32).view(1, tokens.shape[1], -1)
    ok = True
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        model = transformers.AutoModelForCausalLM.from_pretrained(folder).to(dtype).eval()
        name = type(model).__name__
        with torch.no_grad():
            theirs = model(tokens).logits.float()
        difference = ((theirs - ours).abs().max() / ours.abs().max()).item()
        print(f"transformers {transformers.__version__}, {name} in {dtype}: largest logit difference "
              f"{difference:.3g} of the largest logit (tolerance {tolerance})")
        ok = ok and name == "LlamaForCausalLM" and difference <= tolerance
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
