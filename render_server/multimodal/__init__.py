"""Images on the render tier: fetching media safely, decoding it and processing it for the model."""
