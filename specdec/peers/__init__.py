"""llama.cpp and other engines beside ours, as peers of an evaluation."""
