"""The actor runtime: admission, queue, dispatcher, engine and metrics actors in one nursery."""
