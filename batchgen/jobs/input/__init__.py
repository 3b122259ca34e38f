"""Reading a job file: formats, the streaming reader, rows and their sampling fields, OpenAI batch lines."""
