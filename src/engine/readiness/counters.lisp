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

(defparameter *websocket-close-codes* #(1000 1001 1002 1003 1006 1007 1008 1009 1011)
  "The close codes websocket closes are counted by; any other is counted
as 0.")

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
  ;; Connections closed because their TLS handshake was not done within
  ;; the header timeout.
  (handshake-timeouts 0 :type word)
  ;; Per status of *HEAD-REFUSALS*, the heads refused with it.
  (refused-heads (make-array (length *head-refusals*) :element-type 'word :initial-element 0)
   :type (simple-array word (*)) :read-only t)
  ;; Replies of every kind by status class: index 1 to 5 for 1xx to 5xx.
  (replies-by-class (make-array 6 :element-type 'word :initial-element 0)
   :type (simple-array word (*)) :read-only t)
  ;; Requests answered through a handler, by duration (from the complete
  ;; head to the flushed reply): one count per bound of
  ;; +DURATION-BUCKET-SECONDS+ the duration is within and above the one
  ;; before, then one for longer ones.
  (duration-counts (make-array (1+ (length *duration-bucket-seconds*)) :element-type 'word :initial-element 0)
   :type (simple-array word (*)) :read-only t)
  ;; The sum of those durations, in microseconds.
  (duration-microseconds 0 :type word)
  ;; Websocket messages received whole, and sent (queued).
  (websocket-messages-in 0 :type word)
  (websocket-messages-out 0 :type word)
  ;; Octets of websocket frames received and sent, heads included.
  (websocket-octets-in 0 :type word)
  (websocket-octets-out 0 :type word)
  ;; Websockets closed, per code of *WEBSOCKET-CLOSE-CODES*, then others.
  (websocket-closes (make-array (1+ (length *websocket-close-codes*)) :element-type 'word :initial-element 0)
   :type (simple-array word (*)) :read-only t))

(defun count-reply (counters status)
  "Count a reply with STATUS in its class."
  (when (and (integerp status) (<= 100 status 599))
    (atomic-increment (aref (connection-counters-replies-by-class counters) (floor status 100)))))

(defun count-refused-head (counters status)
  "Count a request the engine refused with STATUS by itself."
  (let ((index (position status *head-refusals* :key #'first)))
    (count-reply counters status)
    (when index
      (atomic-increment (aref (connection-counters-refused-heads counters) index)))))

(defun count-answered-request (counters status microseconds)
  "Count a request answered through a handler with STATUS, which took
MICROSECONDS from its complete head to its reply sent."
  (let* ((bounds *duration-bucket-microseconds*)
         (bucket (loop for index of-type fixnum from 0 below (length bounds)
                       when (<= microseconds (aref bounds index))
                         return index
                       finally (return (length bounds)))))
    (declare (type fixnum microseconds) (type (simple-array fixnum (*)) bounds))
    (count-reply counters status)
    (atomic-increment (aref (connection-counters-duration-counts counters) bucket))
    (atomic-add (connection-counters-duration-microseconds counters) microseconds)))

(defun count-websocket-close (counters code)
  "Count a websocket closed with CODE (1006 when it closed without a frame)."
  (atomic-increment (aref (connection-counters-websocket-closes counters)
                          (or (position code *websocket-close-codes*) (length *websocket-close-codes*)))))
