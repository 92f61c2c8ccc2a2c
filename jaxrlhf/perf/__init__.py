"""Performance accounting: the machine's measured matmul peak and model FLOPs per MFC."""
