"""The exercises, completed. Try them yourself first: the tests say when you are right."""
