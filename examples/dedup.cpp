// Three replica processes load the same 32 MiB of "weights" and publish them: the broker keeps
// one copy, every replica maps it read-only under its own pointer (docs/dedup.md).
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>

#include <glake/sharing/dedup_broker.hpp>
#include <glake/sharing/dedup_client.hpp>

int main() {
  constexpr std::size_t bytes = 32 * glake::MiB;
  char dir[] = "/tmp/glake-dedup-example-XXXXXX";
  if (::mkdtemp(dir) == nullptr) return 1;
  const std::string socket = std::string(dir) + "/broker.sock";

  // The broker, in a process of its own (what glake-dedup --socket PATH runs). It stops when
  // `stop` becomes readable: a byte, or the end of file should this process end early.
  int ready[2], stop[2];
  if (::pipe(ready) != 0 || ::pipe(stop) != 0) return 1;
  const pid_t broker_pid = ::fork();
  if (broker_pid == 0) {
    ::close(ready[0]);
    ::close(stop[1]);
    {
      glake::dedup_broker broker(socket);
      char c = 'r';
      if (::write(ready[1], &c, 1) != 1) ::_exit(1);
      broker.run(stop[0]);
    }  // its destructor removes the socket
    ::_exit(0);
  }
  ::close(ready[1]);
  ::close(stop[0]);
  char up = 0;
  const bool broker_up = ::read(ready[0], &up, 1) == 1;
  ::close(ready[0]);
  if (!broker_up) {
    std::fprintf(stderr, "the broker did not start\n");
    return 1;
  }

  // Each replica reports on a pipe of its own, so a replica that dies gives its reader an end
  // of file rather than a wait; all of them hold on to their mappings until `finish` closes.
  int finish[2];
  if (::pipe(finish) != 0) return 1;
  pid_t replicas[3];
  for (int replica = 0; replica < 3; ++replica) {
    int published[2];
    if (::pipe(published) != 0) return 1;
    replicas[replica] = ::fork();  // a replica; with CUDA it would be exec'd instead
    if (replicas[replica] == 0) {
      ::close(published[0]);
      ::close(finish[1]);
      ::close(stop[1]);
      auto* weights = static_cast<std::uint64_t*>(
          ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
      for (std::size_t i = 0; i < bytes / 8; ++i) weights[i] = i * 0x9E3779B97F4A7C15ULL;  // "loading"
      glake::dedup_client<> dedup(socket);
      const glake::publish_result r = dedup.publish(weights, bytes);
      std::printf("replica %d: %zu pieces, %zu stored, %zu shared (%" PRIu64 " MiB given back)\n", replica, r.pieces,
                  r.stored, r.shared, static_cast<std::uint64_t>(r.shared_bytes / glake::MiB));
      std::fflush(stdout);
      const bool intact = weights[12345] == 12345 * 0x9E3779B97F4A7C15ULL;  // same pointer, same bytes
      char c = intact && r.kept_private == 0 ? 'y' : 'n';
      if (::write(published[1], &c, 1) != 1) ::_exit(1);
      while (::read(finish[0], &c, 1) > 0) {  // until the parent closes it
      }
      ::_exit(0);  // the process's references go with it
    }
    ::close(published[1]);
    char c = 0;  // one after another, so the output reads in order
    const bool ok = replicas[replica] > 0 && ::read(published[0], &c, 1) == 1 && c == 'y';
    ::close(published[0]);
    if (!ok) {
      std::fprintf(stderr, "replica %d failed\n", replica);
      for (int r = 0; r <= replica; ++r) {
        if (replicas[r] > 0) ::kill(replicas[r], SIGKILL);
      }
      ::kill(broker_pid, SIGKILL);
      return 1;
    }
  }
  glake::dedup_client<> observer(socket);
  const auto s = observer.broker_statistics();
  if (!s) {
    std::fprintf(stderr, "the broker did not answer\n");
    return 1;  // the replicas and the broker see their pipes close, and exit
  }
  std::printf("broker: %" PRIu64 " objects, %" PRIu64 " MiB for 3 replicas of %" PRIu64 " MiB; %" PRIu64
              " of %" PRIu64 " publishes answered with a copy already held\n",
              s->objects, s->object_bytes / glake::MiB, static_cast<std::uint64_t>(bytes / glake::MiB), s->shared,
              s->publishes);
  std::fflush(stdout);
  ::close(finish[1]);  // every replica reads its end of file, and exits
  int failures = 0;
  for (pid_t pid : replicas) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    failures += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  char c = 's';
  if (::write(stop[1], &c, 1) != 1) return 1;
  ::waitpid(broker_pid, nullptr, 0);
  std::filesystem::remove_all(dir);
  return failures == 0 && s->object_bytes == bytes && s->shared == 2 * (bytes / (2 * glake::MiB)) ? 0 : 1;
}
