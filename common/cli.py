def main():
    print("baton")
