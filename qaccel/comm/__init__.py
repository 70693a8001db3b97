"""One rank's session and what ranks say to each other: the process group, collectives, coordination, hang
reports. Knows nothing of models or launchers."""
