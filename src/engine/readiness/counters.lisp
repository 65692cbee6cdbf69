;;;; What the readiness engine counts, ever: kept by the engine from run to
;;;; run, counted into by each run's readiness set, without a lock (atomic
;;;; words).  Read as TASKMASTER-STATISTICS (statistics.lisp).

(in-package #:hunchentoot-recycling-taskmaster)

(defparameter *duration-bucket-seconds* #(0.0005 0.001 0.0025 0.005 0.01 0.025 0.05 0.1 0.25 0.5 1 2.5 5 10)
  "The upper bounds of the request-duration histogram's buckets, in seconds.")

(defparameter *duration-bucket-microseconds*
  (map '(simple-array fixnum (*)) (lambda (seconds) (round (* seconds 1000000)))
       *duration-bucket-seconds*)
  "The same bounds in microseconds, so that counting a request conses
nothing.")

(defparameter *websocket-close-codes* #(1000 1001 1002 1003 1006 1007 1008 1009 1011 1013)
  "The close codes websocket closes are counted by; any other is counted
as 0.")

(defparameter *counted-application-protocols* #("h2" "http/1.1" "other" "none")
  "What TLS handshakes are counted by: the protocol ALPN chose among those
named, \"other\" for another, \"none\" when it chose none.")

(defparameter *http2-goaway-causes* #(:stop :idle :protocol-error :flood :slow-reader :refused)
  "Why the engine sends an HTTP/2 connection its GOAWAY, as counted: the
acceptor stops; the connection was idle for the keep-alive timeout; the
client broke the protocol (a frame out of place: libnghttp2's verdict);
it sent what costs the server without end (frames that carry nothing, a
header list decoded past all bounds: ENHANCE_YOUR_CALM); it took none of
what was sent to it for the write timeout; or it was refused before any
worker took it (every worker busy past the queue timeout, the memory
budget spent).")

(defconstant +request-count-stripes+ 8
  "The stripes requests are counted in, each worker counting into one: a
word every worker added to would move between the processors' caches at
every request (counting a reply was 2.5% of a 0 ms request).  Reading a
count sums its stripes.")

(defconstant +request-count-stripe-words+ 32
  "The words of one stripe: those REQUEST-COUNT-WORD names, and room enough
(8 words) that no two stripes share a cache line.")

(defstruct (connection-counters (:constructor make-connection-counters ()))
  "What the readiness sets of one engine have counted, ever.  The engine
keeps it from run to run; each run's set counts into it."
  ;; Connections taken from the listening socket.
  (accepted 0 :type word)
  ;; Parked keep-alive connections closed at the keep-alive timeout.
  (keep-alive-timeouts 0 :type word)
  ;; Connections closed because their client took none of its reply for
  ;; the acceptor's write timeout.
  (write-timeouts 0 :type word)
  ;; Requests answered 408 because their body stalled for the read timeout.
  (body-timeouts 0 :type word)
  ;; Deferred replies answered at their timeout, and those whose client
  ;; hung up before they were completed.
  (deferred-timeouts 0 :type word)
  (deferred-clients-gone 0 :type word)
  ;; Events offered to event streams, and the streams closed because
  ;; their client took too little of them.
  (events-sent 0 :type word)
  (event-streams-not-reading 0 :type word)
  ;; Connections closed because their TLS handshake was not done within
  ;; the header timeout.
  (handshake-timeouts 0 :type word)
  ;; Batches of replies sent by another worker, their owner held up
  ;; (reply-batch.lisp).
  (batches-sent-in-place 0 :type word)
  ;; Per status of *HEAD-REFUSALS*, the heads refused with it.
  (refused-heads (make-array (length *head-refusals*) :element-type 'word :initial-element 0)
   :type (simple-array word (*)) :read-only t)
  ;; Replies by status class, and requests answered through a handler by
  ;; duration, in stripes (REQUEST-COUNT-WORD).
  (request-counts (make-array (* +request-count-stripes+ +request-count-stripe-words+)
                              :element-type 'word :initial-element 0)
   :type (simple-array word (*)) :read-only t)
  ;; Websocket messages received whole, and sent (queued).
  (websocket-messages-in 0 :type word)
  (websocket-messages-out 0 :type word)
  ;; Octets of websocket frames received and sent, heads included.
  (websocket-octets-in 0 :type word)
  (websocket-octets-out 0 :type word)
  ;; Websockets closed, per code of *WEBSOCKET-CLOSE-CODES*, then others.
  (websocket-closes (make-array (1+ (length *websocket-close-codes*)) :element-type 'word :initial-element 0)
   :type (simple-array word (*)) :read-only t)
  ;; HTTP/2 connections opened; streams begun by their clients; streams
  ;; their clients reset before the reply ended; streams the engine
  ;; refused (REFUSED_STREAM) because as many handlers as the concurrent
  ;; stream limit ran or waited for that connection already.
  (http2-connections 0 :type word)
  (http2-streams 0 :type word)
  (http2-streams-reset 0 :type word)
  (http2-streams-refused 0 :type word)
  ;; GOAWAYs sent, per cause of *HTTP2-GOAWAY-CAUSES*.
  (http2-goaways (make-array (length *http2-goaway-causes*) :element-type 'word :initial-element 0)
   :type (simple-array word (*)) :read-only t)
  ;; TLS handshakes the engine finished, per *COUNTED-APPLICATION-PROTOCOLS*.
  (tls-handshakes (make-array (length *counted-application-protocols*) :element-type 'word :initial-element 0)
   :type (simple-array word (*)) :read-only t))

(declaim (inline request-count-word))
(defun request-count-word (stripe counted &optional (index 0))
  "The word of the request counts for COUNTED in STRIPE: :REPLIES, by status
class INDEX (1 to 5 for 1xx to 5xx); :DURATIONS, requests answered through
a handler by duration, INDEX the bucket of *DURATION-BUCKET-SECONDS* the
duration (from the complete head to the flushed reply) is within and above
the one before, or one more for longer ones; :MICROSECONDS, the sum of those
durations."
  (declare (type fixnum stripe index))
  (+ (* stripe +request-count-stripe-words+)
     (ecase counted
       (:replies index)
       (:durations (+ 6 index))
       (:microseconds (load-time-value (+ 6 1 (length *duration-bucket-seconds*)) t)))))

(assert (<= (+ (request-count-word 0 :microseconds) 1 8) +request-count-stripe-words+) ()
        "A stripe of request counts has no room left for the duration buckets and a cache line.")

(defun request-count (counters counted &optional (index 0))
  "The request count COUNTED (see REQUEST-COUNT-WORD) of COUNTERS: the sum
of its stripes."
  (loop for stripe below +request-count-stripes+
        sum (aref (connection-counters-request-counts counters) (request-count-word stripe counted index))))

(defun count-reply (counters status &optional (stripe 0))
  "Count a reply with STATUS in its class, in STRIPE."
  (when (and (integerp status) (<= 100 status 599))
    (atomic-increment (aref (connection-counters-request-counts counters)
                            (request-count-word stripe :replies (floor status 100))))))

(defun count-refused-head (counters status)
  "Count a request the engine refused with STATUS by itself."
  (let ((index (position status *head-refusals* :key #'first)))
    (count-reply counters status)
    (when index
      (atomic-increment (aref (connection-counters-refused-heads counters) index)))))

(defun count-answered-request (counters stripe status microseconds)
  "Count a request answered through a handler with STATUS, which took
MICROSECONDS from its complete head to its reply sent, in STRIPE."
  (let* ((bounds *duration-bucket-microseconds*)
         (bucket (loop for index of-type fixnum from 0 below (length bounds)
                       when (<= microseconds (aref bounds index))
                         return index
                       finally (return (length bounds))))
         (counts (connection-counters-request-counts counters)))
    (declare (type fixnum microseconds) (type (simple-array fixnum (*)) bounds))
    (count-reply counters status stripe)
    (atomic-increment (aref counts (request-count-word stripe :durations bucket)))
    (atomic-add (aref counts (request-count-word stripe :microseconds)) microseconds)))

(defun count-websocket-close (counters code)
  "Count a websocket closed with CODE (1006 when it closed without a frame)."
  (atomic-increment (aref (connection-counters-websocket-closes counters)
                          (or (position code *websocket-close-codes*) (length *websocket-close-codes*)))))

(defun count-tls-handshake (counters protocol)
  "Count a TLS handshake finished with PROTOCOL chosen by ALPN (a string, or NIL)."
  (let ((protocols *counted-application-protocols*))
    (atomic-increment (aref (connection-counters-tls-handshakes counters)
                            (cond ((null protocol) (1- (length protocols)))
                                  ((position protocol protocols :end (- (length protocols) 2) :test #'string=))
                                  (t (- (length protocols) 2)))))))

(defun count-http2-goaway (counters cause)
  "Count a GOAWAY sent for CAUSE, one of *HTTP2-GOAWAY-CAUSES*."
  (atomic-increment (aref (connection-counters-http2-goaways counters) (position cause *http2-goaway-causes*))))
