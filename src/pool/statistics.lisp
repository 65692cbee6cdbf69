;;;; Observing a running pool.

(in-package #:hunchentoot-recycling-taskmaster)

(defmethod hunchentoot:taskmaster-thread-count ((taskmaster recycling-taskmaster))
  (pool-thread-count taskmaster))

(defgeneric taskmaster-statistics (taskmaster)
  (:documentation "A fresh plist describing TASKMASTER's pool (TASKMASTER may
also be a PARALLEL-ACCEPTOR, meaning its taskmaster) now, cheap enough to
poll.  The pool's keys: :THREADS (workers in the pool), :BUSY-THREADS
(workers not waiting for work), :ACCEPTING-THREADS (workers waiting for
work), :IN-REQUEST-THREADS (workers between a complete request head and its
reply), and the totals since the taskmaster was made :REQUESTS-SERVED,
:THREADS-CREATED, :THREADS-RETIRED, :PEAK-THREADS, and :GROWTH-DECLINED
(times the pool was asked to grow while the processors had no idle time,
and did not).  Then the engine's keys,
once the taskmaster has been started; the readiness engine's are
:PARKED-CONNECTIONS (connections waiting without a thread, for bytes or
for room to write), :OPEN-CONNECTIONS (parked or being served),
:UNSENT-REPLIES (connections whose reply the socket has not taken whole,
waiting for their client to read), :ARRIVING-BODIES (requests whose body
the engine is reading, before dispatch), :TLS-HANDSHAKES (connections
whose TLS handshake the engine is taking), and the totals
:CONNECTIONS-ACCEPTED, :KEEP-ALIVE-TIMEOUTS (kept-alive connections closed
after KEEP-ALIVE-TIMEOUT idle seconds), :WRITE-TIMEOUTS (connections closed
because their client took none of its reply for the acceptor's write
timeout), :BODY-TIMEOUT-REPLIES (requests answered 408 because their body
stalled for the read timeout), :HANDSHAKE-TIMEOUTS (connections closed
because their TLS handshake was not done within the header timeout), and
one count per refused request
head: :BAD-REQUEST-REPLIES (400: malformed, ambiguous framing, missing or invalid Host),
:HEADER-TIMEOUT-REPLIES (408), :LENGTH-REQUIRED-REPLIES (411, a chunked
body to an acceptor without input chunking), :CONTENT-TOO-LARGE-REPLIES
(413, a body over MAX-BODY-BYTES), :URI-TOO-LONG-REPLIES (414),
:HEADER-TOO-LARGE-REPLIES (431), :BODY-NOT-STORED-REPLIES (500, a body
the temporary directory would not take), :NOT-IMPLEMENTED-REPLIES (501, a transfer
coding other than chunked), :QUEUE-TIMEOUT-REPLIES (503, a complete request
that waited QUEUE-TIMEOUT for a worker) and :VERSION-NOT-SUPPORTED-REPLIES
(505); :REPLIES-BY-CLASS, an alist from 1 to 5 (1xx to 5xx) to the replies
of that class, refusals included; and the histogram of requests answered
through a handler, by seconds from the complete head to the flushed reply:
:REQUEST-DURATION-BUCKETS, an alist from each upper bound to the count of
requests that took at most that long, :REQUEST-DURATION-COUNT and
:REQUEST-DURATION-SECONDS (their sum).  PROMETHEUS-METRICS formats them.
The order of keys is unspecified.  The pool's counts are taken under its
lock in one go; the engine's counts and :REQUESTS-SERVED may lag by the
work finishing while they are read."))

(defmethod taskmaster-statistics ((taskmaster recycling-taskmaster))
  (let ((engine (taskmaster-engine taskmaster)))
    (append
     (with-pool-lock (taskmaster)
       (let ((waiting (waiting-worker-count taskmaster)))
         (list :threads (pool-thread-count taskmaster)
               :busy-threads (max 0 (- (pool-thread-count taskmaster) waiting))
               :accepting-threads waiting
               :in-request-threads (in-request-count taskmaster)
               :requests-served (+ (retired-requests-served taskmaster)
                                   (reduce #'+ (pool-workers taskmaster) :key #'worker-requests-served))
               :threads-created (threads-created taskmaster)
               :threads-retired (threads-retired taskmaster)
               :peak-threads (peak-thread-count taskmaster)
               :growth-declined (growth-declined-count taskmaster))))
     (and engine (engine-statistics engine)))))

(defmethod taskmaster-statistics ((acceptor parallel-acceptor))
  "The statistics of ACCEPTOR's taskmaster, for code that holds the acceptor
(Hunchentoot does not export the taskmaster reader)."
  (taskmaster-statistics (acceptor-taskmaster acceptor)))
