"""Fifty sentences for the embedding tests: short, long, unicode, and some over all-MiniLM-L6-v2's 256 tokens."""

_LONG = ("Retrieval-augmented generation sends most of its traffic to an embedding model, which turns each "
         "passage of a corpus into a vector so that the passages nearest to a question can be found quickly. ")
SENTENCES = [
    "Hello world", "A", "?", "The cat sits on the mat.", "Embeddings map text to vectors.",
    "How do I reset my password?", "Paris is the capital of France.", "The quick brown fox jumps over the lazy dog.",
    "I love machine learning!", "This is a test.", "Completely unrelated: bananas are yellow.",
    "Transformers use attention to mix information between tokens.", "   leading and trailing spaces   ",
    "UPPER CASE SENTENCE", "numbers 12345 and 3.14159 and 1e-12", "email@example.com https://example.org/path?q=1",
    "tabs\tand\nnewlines", "repeated repeated repeated repeated repeated", "a b c d e f g h i j k l m n o p",
    "Can a sentence end without punctuation", "¿Dónde está la biblioteca?", "Ünïcödé çhåråctérs äre fün",
    "東京は日本の首都です。", "北京欢迎你", "Привет, как дела?", "مرحبا بالعالم", "שלום עולם",
    "नमस्ते दुनिया", "Γειά σου Κόσμε", "emoji 😀🚀🎉 in text", "e\u0301 combining accent", "ß and ẞ and ﬁ ligature",
    "한국어 문장입니다", "ไทย ภาษา", "mixed English 和 中文 text", "code: def f(x): return x ** 2",
    "JSON: {\"key\": [1, 2, 3]}", "<html><body>markup</body></html>",
    _LONG, _LONG * 2, _LONG * 4, _LONG * 6, "ünïcödé " * 200,  # 41 to 236 tokens
    _LONG * 8, "word " * 300, "東京 " * 400, " ".join(f"token{i}" for i in range(200)),  # cut to 256 tokens
    "a" * 1000,  # one word past the tokenizer's 100 characters: [UNK]
    "The end.", "Fin.",
]
