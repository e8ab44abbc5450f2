"""linearize: turn a pretrained softmax-attention LLM into a hybrid linear-attention model."""

__version__ = "0.1.0"
