"""`batchyard deploy`: SageMaker endpoints for the batchyard container, with boto3 only.

cli.py (argument parsing, one-line errors) → endpoint.py (create), switch.py, cleanup.py (delete),
autoscale.py, invoke.py; artifacts.py uploads serving.properties and model files to S3; checks.py
validates inputs before anything is created; aws.py holds the clients and the error translation.
"""
