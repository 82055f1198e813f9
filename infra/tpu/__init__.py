"""The Cloud TPU API boundary, placing a node in a zone, and nodes the state does not hold."""
