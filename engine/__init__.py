"""radixserve's inference engine as a library: no HTTP, no ZMQ."""
