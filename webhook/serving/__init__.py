"""The HTTP serving stack: the Flask app, the gunicorn worker and its connections, the review log."""
