"""modelfs command line."""
