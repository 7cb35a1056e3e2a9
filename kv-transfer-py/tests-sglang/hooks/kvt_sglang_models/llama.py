from sglang.srt.models.llama import LlamaForCausalLM

EntryClass = LlamaForCausalLM
