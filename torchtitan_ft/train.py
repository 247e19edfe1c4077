"""``python -m torchtitan_ft.train``: the trainer's entry point under the name it had before the
plugin's modules moved to :mod:`torchtitan_ft.titan` (run_train.sh's ``TRAIN_FILE`` in users'
scripts); it is :mod:`torchtitan_ft.titan.train`."""

from torchtitan_ft.titan.train import main

if __name__ == "__main__":
    main()
