"""The release half of training: a finished run turned into a heads folder with its model card
(publish), and runs compared on their held-out evaluation (comparison)."""
