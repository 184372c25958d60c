"""Local tools: the one-machine stack, embedded Redis, test models and the stock P/D proxy."""
