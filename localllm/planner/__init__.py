"""Pure planning: from a model's shape, a card and a request to a `Plan`, with its predicted
memory, speed and reasons. Nothing here reads a file or starts a process (the card specs in
planner/cards/ and the CPU's physical core count aside); measurements come in as arguments."""
