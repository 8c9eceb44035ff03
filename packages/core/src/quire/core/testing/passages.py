"""Passages that prompts ask a model to repeat or edit (speculative decoding's tests and benchmark)."""

PASSAGES = [
    "The river runs through the old town, past the market square and the stone bridge, where fishermen wait "
    "in the early morning for the boats to return with the day's catch.",
    "To install the package, download the archive, unpack it into a folder of your choice, and run the setup "
    "script from that folder with administrator rights.",
    "Every spring the gardeners plant rows of tulips along the main avenue, and by April the whole street is "
    "red, yellow and white from one end to the other.",
]
