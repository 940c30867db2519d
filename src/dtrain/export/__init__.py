"""A run's weights for other programs: the final `model.safetensors` and `load_weights` (weights.py), a
Hugging Face model folder (hf.py) and a LoRA run's adapters or merged model (lora.py)."""
