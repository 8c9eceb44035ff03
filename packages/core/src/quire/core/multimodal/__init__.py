"""Image inputs, handled in the front end (the API process): finding images in prompts (``parts``), loading
them from data URLs, allowed files and allowed hosts (``media``, ``fetch``), running the model's Hugging Face
processor and splitting its outputs into one ``MultiModalFeature`` per image (``processing``, ``features``).

NOTE: nothing in the engine core imports this package; the engine core receives processed tensors as raw
buffers and never loads an image library or a tokenizer for them.
"""
