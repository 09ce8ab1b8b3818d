"""The API's errors: an HTTP status with an OpenAI-shaped body (shared by every serve module)."""


class APIError(Exception):
    """An HTTP error with an OpenAI-shaped body."""

    def __init__(self, status, message, type="invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code)

    def body(self):
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def invalid(message, param=None, code=None):
    return APIError(400, message, "invalid_request_error", param, code)
