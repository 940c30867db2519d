"""The training loop and what one step needs: the Trainer, loss, precision, optimizer, evaluation, stopping."""
