"""The built-in GPT (model.py) and how tensor parallel splits it (tp_plan.py)."""

from dtrain.models.gpt.model import GPT, document_causal_mask

__all__ = ["GPT", "document_causal_mask"]
