;;;; The readiness set of a PARALLEL-ACCEPTOR: one epoll set holding the
;;;; listening socket and every connection that waits for bytes, and the
;;;; table of those connections.  Workers wait on the set; whichever wakes
;;;; takes what is ready.
;;;;
;;;; Ownership.  A connection is :ACTIVE while exactly one thread holds it,
;;;; :PARKED while it waits in the set, and :CLOSED at the end.  Only the
;;;; holder of an :ACTIVE connection touches it.  Parking sets :PARKED before
;;;; arming the descriptor (one-shot), and every taker -- the worker woken
;;;; for it, the sweeper closing it at its deadline, HUNCHENTOOT:STOP --
;;;; must win a compare-and-swap from :PARKED to :ACTIVE first, so that two
;;;; threads never serve one connection.  A worker woken with a token whose
;;;; slot now holds another connection (the generation differs) drops it.
;;;;
;;;; TABLE-LOCK guards the slot table and its free list, taken when a
;;;; connection enters or leaves the table, never around I/O.

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +listen-token+ 0)
(defconstant +wakeup-token+ 1)
(defconstant +first-connection-token+ 2)

(defstruct (connection (:constructor make-connection (fd token fd-stream)))
  "A client connection served by the readiness set."
  ;; :ACTIVE, :PARKED or :CLOSED; see Ownership above.
  (state :active)
  (fd -1 :type fixnum :read-only t)
  (token 0 :type word :read-only t)
  ;; The binary stream on FD.
  (fd-stream nil :read-only t)
  ;; The stream requests are read from and replies written to: FD-STREAM,
  ;; or the TLS stream over it.
  (stream nil)
  ;; The octets that arrived and are not yet answered (part of a head, or
  ;; pipelined requests), or NIL.
  (pending nil)
  ;; What a parked connection waits for: :INPUT (a request's octets, head
  ;; or body) or :OUTPUT (room in the socket buffer for the rest of its
  ;; reply).
  (awaiting :input)
  ;; The OUTGOING rest of a reply the socket did not take whole, or NIL.
  (outgoing nil)
  ;; The ARRIVING-BODY of a request whose body the engine is reading, or NIL.
  (arriving-body nil)
  ;; The TLS stream whose handshake the engine is taking, before the
  ;; connection has a STREAM; NIL otherwise (tls-handshake.lisp).
  (handshake nil)
  ;; While it waits for output: the octets its client had not acknowledged
  ;; when it was last parked or looked at, or NIL.
  (unacknowledged nil)
  ;; True once the descriptor has been added to the epoll set.
  (armed-p nil)
  ;; True once a request of this connection has been answered: before, a
  ;; soft STOP waits for it (ENGINE-DRAIN).
  (answered-p nil)
  ;; Internal real time at which a parked connection is ended.
  (deadline 0 :type fixnum)
  ;; What the client is answered at DEADLINE: 408 when it is the header
  ;; timeout, 503 when it is the queue timeout of a complete request, NIL
  ;; when it is the keep-alive timeout (closed without a word).
  (timeout-status nil)
  ;; The peer's and our address and port, as Hunchentoot's request holds
  ;; them: read once per connection, not once per request.
  (addresses '() :type list)
  ;; The CONNECTION-SOCKET that HUNCHENTOOT:PROCESS-CONNECTION is called
  ;; with for this connection.
  (socket nil)
  ;; Internal real time the head being read began to arrive (or the
  ;; connection was accepted); NIL between requests of a kept-alive one.
  (head-started nil :type (or null fixnum)))

(defmethod print-object ((connection connection) stream)
  (print-unreadable-object (connection stream :type t :identity t)
    (format stream "fd ~D ~S" (connection-fd connection) (connection-state connection))))

(defparameter *duration-bucket-seconds* #(0.0005 0.001 0.0025 0.005 0.01 0.025 0.05 0.1 0.25 0.5 1 2.5 5 10)
  "The upper bounds of the request-duration histogram's buckets, in seconds.")

(defparameter *duration-bucket-units*
  (map '(simple-array fixnum (*)) (lambda (seconds) (round (* seconds internal-time-units-per-second)))
       *duration-bucket-seconds*)
  "The same bounds in internal time units, so that counting a request conses
nothing.")

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
  (duration-microseconds 0 :type word))

(defstruct (readiness-set (:constructor %make-readiness-set))
  (epoll-fd -1 :type fixnum :read-only t)
  (wakeup-fd -1 :type fixnum :read-only t)
  ;; The acceptor's listening socket, non-blocking.
  (listen-fd -1 :type fixnum :read-only t)
  ;; True while accepting pauses: accept(2) failed for a reason that lasts
  ;; (EMFILE, ENFILE), and the listening socket is left disarmed until the
  ;; next sweep, instead of a worker sleeping or spinning on it.
  (accept-paused-p nil)
  ;; True once accepting has stopped for good, for a soft STOP: the
  ;; listening socket is never armed again.
  (accepting-stopped-p nil)
  ;; A descriptor held in reserve, so that a message can still be logged when
  ;; the process has no other free (Hunchentoot opens the log file for every
  ;; message); NIL when none could be kept.
  (spare-fd nil)
  (table-lock (bt:make-lock "readiness-set-table") :read-only t)
  ;; Index -> the CONNECTION holding it, or NIL.
  (slots (make-array 1024 :initial-element nil) :type simple-vector)
  (free-indices '())
  (next-index 0 :type fixnum)
  (generation 0 :type fixnum)
  ;; Internal time units a request head may take to arrive.
  (header-timeout 0 :type fixnum :read-only t)
  ;; Internal time units a kept-alive connection may wait for its next request.
  (keep-alive-timeout 0 :type fixnum :read-only t)
  ;; Internal time units a complete request may wait for a free worker.
  (queue-timeout 0 :type fixnum :read-only t)
  ;; Internal time units a reply may wait for its client to take any of it.
  (write-timeout 0 :type fixnum :read-only t)
  ;; Internal time units a request body may stall between two octets.
  (read-timeout 0 :type fixnum :read-only t)
  ;; What the Retry-After header of a 503 says.
  (retry-after-seconds 0 :type fixnum :read-only t)
  ;; What the Server header of a refusal says: the acceptor's server name.
  (server-name "" :type string :read-only t)
  ;; Called with the connection and the status of every refusal, after its
  ;; reply is sent: the acceptor's access log.
  (refusal-logger (constantly nil) :type function :read-only t)
  ;; Connections in the table, held by workers or parked.
  (connection-count 0 :type fixnum)
  ;; Connections parked now.
  (parked-count 0 :type word)
  ;; Connections whose reply is left to send, parked or being sent.
  (outgoing-count 0 :type word)
  ;; Connections whose request body is arriving, parked or being read.
  (arriving-body-count 0 :type word)
  ;; Connections whose TLS handshake the engine is taking, parked or not.
  (handshake-count 0 :type word)
  ;; The engine's CONNECTION-COUNTERS, which this set counts into.
  (counters nil :type connection-counters :read-only t))

(defmethod print-object ((set readiness-set) stream)
  (print-unreadable-object (set stream :type t :identity t)
    (format stream "epoll fd ~D, ~D connections, ~D parked"
            (readiness-set-epoll-fd set) (readiness-set-connection-count set) (readiness-set-parked-count set))))

(defun make-readiness-set (listen-socket counters
                           &key header-timeout keep-alive-timeout queue-timeout write-timeout read-timeout
                             server-name refusal-logger)
  "A readiness set watching LISTEN-SOCKET (made non-blocking: a worker woken
for it may find the connection already taken), counting into COUNTERS.  The
timeouts are in seconds; a WRITE-TIMEOUT or READ-TIMEOUT of NIL means a year."
  (let* ((epoll-fd (make-epoll-set))
         (set (%make-readiness-set :epoll-fd epoll-fd :wakeup-fd (make-wakeup-fd)
                                   :listen-fd (socket-file-descriptor listen-socket)
                                   :counters counters
                                   :header-timeout (seconds->internal-units header-timeout)
                                   :keep-alive-timeout (seconds->internal-units keep-alive-timeout)
                                   :queue-timeout (seconds->internal-units queue-timeout)
                                   :write-timeout (seconds->internal-units (or write-timeout 31536000))
                                   :read-timeout (seconds->internal-units (or read-timeout 31536000))
                                   :retry-after-seconds (ceiling queue-timeout)
                                   :server-name server-name
                                   :refusal-logger refusal-logger)))
    (setf (readiness-set-spare-fd set) (open-spare-fd))
    (set-non-blocking listen-socket)
    (epoll-watch epoll-fd (readiness-set-listen-fd set) +listen-token+ :one-shot t)
    (epoll-watch epoll-fd (readiness-set-wakeup-fd set) +wakeup-token+)
    set))

(defun destroy-readiness-set (set)
  (close-fd (readiness-set-epoll-fd set))
  (close-fd (readiness-set-wakeup-fd set))
  (let ((spare-fd (shiftf (readiness-set-spare-fd set) nil)))
    (when spare-fd (close-fd spare-fd))))

(defun call-with-spare-descriptor (set function)
  "Call FUNCTION with SET's spare descriptor given up, so that FUNCTION can
open one file though the process has no other descriptor free; keep a spare
again afterwards if one can be had.  Called by one thread at a time: the
worker whose accept(2) failed, before it lets another accept."
  (let ((spare-fd (shiftf (readiness-set-spare-fd set) nil)))
    (when spare-fd (close-fd spare-fd))
    (unwind-protect (funcall function)
      (setf (readiness-set-spare-fd set) (open-spare-fd)))))

(defun rearm-listen-socket (set)
  "Arm the listening socket again, unless accepting has stopped: looked at
again after arming, since STOP-ACCEPTING may have disarmed it meanwhile."
  (unless (readiness-set-accepting-stopped-p set)
    (epoll-rearm (readiness-set-epoll-fd set) (readiness-set-listen-fd set) +listen-token+)
    (memory-barrier)
    (when (readiness-set-accepting-stopped-p set)
      (epoll-disarm (readiness-set-epoll-fd set) (readiness-set-listen-fd set) +listen-token+))))

(defun stop-accepting (set)
  "Take no connection from the listening socket any more."
  (setf (readiness-set-accepting-stopped-p set) t)
  (memory-barrier)
  (epoll-disarm (readiness-set-epoll-fd set) (readiness-set-listen-fd set) +listen-token+))

(defun refuse-connections (set)
  "Make SET's listening socket, whose accepting has stopped, stop listening:
the kernel refuses a client connecting from now on (ECONNREFUSED, which a
load balancer retries elsewhere at once), where closing the socket later
would reset those it had queued.  The descriptor stays open until the
listening socket is closed, so its number is not taken by another socket
while a worker may still name it."
  (shut-down-fd (readiness-set-listen-fd set)))

(defun unfinished-connection-count (set)
  "Connections in SET's table none of whose requests has been answered yet,
or whose reply is not sent whole yet."
  (count-if (lambda (connection)
              (and connection
                   (or (not (connection-answered-p connection))
                       (connection-outgoing connection))
                   (not (eq (connection-state connection) :closed))))
            (readiness-set-slots set)))

(defun pause-accepting (set)
  "Leave the listening socket disarmed until RESUME-ACCEPTING."
  (setf (readiness-set-accept-paused-p set) t))

(defun resume-accepting (set)
  "Arm the listening socket again if accepting was paused."
  (when (readiness-set-accept-paused-p set)
    (setf (readiness-set-accept-paused-p set) nil)
    (rearm-listen-socket set)))

(defun wake-all-waiters (set)
  "Make every epoll_wait on SET, now and later, return at once."
  (signal-wakeup-fd (readiness-set-wakeup-fd set)))

(defun count-accepted-connection (set)
  (atomic-increment (connection-counters-accepted (readiness-set-counters set))))

(defun count-reply (counters status)
  "Count a reply with STATUS in its class."
  (when (and (integerp status) (<= 100 status 599))
    (atomic-increment (aref (connection-counters-replies-by-class counters) (floor status 100)))))

(defun count-refused-head (set status)
  (let ((index (position status *head-refusals* :key #'first))
        (counters (readiness-set-counters set)))
    (count-reply counters status)
    (when index
      (atomic-increment (aref (connection-counters-refused-heads counters) index)))))

(defun count-answered-request (set status started)
  "Count a request answered through a handler with STATUS, whose head was
complete at STARTED (internal real time)."
  (let* ((counters (readiness-set-counters set))
         (units (max 0 (- (get-internal-real-time) started)))
         (bounds *duration-bucket-units*)
         (bucket (loop for index of-type fixnum from 0 below (length bounds)
                       when (<= units (aref bounds index))
                         return index
                       finally (return (length bounds)))))
    (declare (type fixnum units) (type (simple-array fixnum (*)) bounds))
    (count-reply counters status)
    (atomic-increment (aref (connection-counters-duration-counts counters) bucket))
    (atomic-add (connection-counters-duration-microseconds counters)
                (floor (* units 1000000) internal-time-units-per-second))))

;;; The table.

(defun slot-index (token)
  (- (ldb (byte 32 0) token) +first-connection-token+))

(defun add-connection (set fd fd-stream)
  "Enter the accepted connection FD, with its FD-STREAM, into SET's table;
its CONNECTION, :ACTIVE."
  (bt:with-lock-held ((readiness-set-table-lock set))
    (let* ((index (or (pop (readiness-set-free-indices set))
                      (prog1 (readiness-set-next-index set)
                        (incf (readiness-set-next-index set)))))
           (generation (setf (readiness-set-generation set)
                             (ldb (byte 31 0) (1+ (readiness-set-generation set)))))
           (connection (make-connection fd (dpb generation (byte 31 32) (+ index +first-connection-token+))
                                        fd-stream)))
      (when (>= index (length (readiness-set-slots set)))
        (setf (readiness-set-slots set)
              (replace (make-array (* 2 (length (readiness-set-slots set))) :initial-element nil)
                       (readiness-set-slots set))))
      (setf (svref (readiness-set-slots set) index) connection)
      (incf (readiness-set-connection-count set))
      connection)))

(defun remove-connection (set connection)
  "Take CONNECTION, which the caller holds, out of SET's table."
  (setf (connection-state connection) :closed)
  (bt:with-lock-held ((readiness-set-table-lock set))
    (let ((index (slot-index (connection-token connection))))
      (when (eq (svref (readiness-set-slots set) index) connection)
        (setf (svref (readiness-set-slots set) index) nil)
        (push index (readiness-set-free-indices set))
        (decf (readiness-set-connection-count set))))))

(defun plain-connection-p (connection)
  "True when CONNECTION speaks plain HTTP, not TLS."
  (eq (connection-stream connection) (connection-fd-stream connection)))

(defun take-parked-connection (set connection)
  "Make the caller CONNECTION's holder if it is parked.  True when it was."
  (when (compare-and-swap (connection-state connection) :parked :active)
    (atomic-decrement (readiness-set-parked-count set))
    t))

(defun take-ready-connection (set token)
  "The parked connection TOKEN was reported for, now held by the caller; NIL
when it is gone or another thread took it."
  (let* ((slots (readiness-set-slots set))
         (index (slot-index token))
         (connection (and (< index (length slots)) (svref slots index))))
    (and connection
         (= (connection-token connection) token)
         (take-parked-connection set connection)
         connection)))

(defun park-connection (set connection deadline)
  "Give up CONNECTION until what it is AWAITING happens -- bytes arrive, or
its socket has room -- or DEADLINE passes (then it gets its
TIMEOUT-STATUS).  True when it is parked (and may already be another
thread's); false when the descriptor could not be armed and the caller
still holds the connection."
  (let ((first-time-p (not (connection-armed-p connection))))
    ;; Everything the next holder reads is written before arming: once
    ;; armed, the connection may be taken before epoll_ctl even returns.
    (setf (connection-deadline connection) deadline
          (connection-armed-p connection) t
          (connection-state connection) :parked)
    (atomic-increment (readiness-set-parked-count set))
    (or (if first-time-p
            (epoll-watch (readiness-set-epoll-fd set) (connection-fd connection)
                         (connection-token connection) :one-shot t :awaited (connection-awaiting connection))
            (epoll-rearm (readiness-set-epoll-fd set) (connection-fd connection)
                         (connection-token connection) :awaited (connection-awaiting connection)))
        ;; Not armed; the sweeper may have taken it at its deadline meanwhile.
        (not (take-parked-connection set connection)))))

(defun map-parked-connections (set function)
  "Call FUNCTION on every connection parked in SET now.  It is not taken: it
may be taken by a worker before or while FUNCTION runs."
  (let ((slots (readiness-set-slots set)))
    (loop for connection across slots
          when (and connection (eq (connection-state connection) :parked))
            do (funcall function connection))))

;;; Ending connections.

(defun close-connection (set connection)
  "Close CONNECTION, which the caller holds, and forget it.  Errors mean the
client is gone already."
  (remove-connection set connection)
  (when (connection-outgoing connection)
    (drop-outgoing set connection))
  (when (connection-arriving-body connection)
    (discard-arriving-body set connection))
  (when (connection-handshake connection)
    (end-connection-handshake set connection))
  (let ((stream (connection-stream connection))
        (fd-stream (connection-fd-stream connection)))
    (when (and stream (not (eq stream fd-stream)))
      (ignore-errors (close stream :abort t))
      (forget-tls-errors))
    (ignore-errors (close fd-stream :abort t))))

(defun refuse-and-close (set connection status &key explanation)
  "Answer CONNECTION's request with the error reply for STATUS and close it;
EXPLANATION, when given, is what its page says instead of what
*HEAD-REFUSALS* says, and the refusal is then counted by the caller.  The
reply and FIN go out before the close, so that the client reads the reply
before the reset that unread input provokes."
  (unless explanation
    (count-refused-head set status))
  (let ((reply (head-error-reply status (readiness-set-server-name set)
                                 (readiness-set-retry-after-seconds set) explanation))
        (stream (connection-stream connection))
        (fd (connection-fd connection)))
    ;; The sweeper calls this too and must not wait.  Plain text that does
    ;; not fit the socket is dropped; TLS is written only while the socket
    ;; has room (a client that sends and never reads may have filled it).
    (ignore-errors
     (cond ((plain-connection-p connection) (send-without-waiting fd reply))
           ((fd-writable-p fd) (write-sequence reply stream) (finish-output stream))))
    (shut-down-fd-output fd)
    (let ((scratch (make-array 4096 :element-type '(unsigned-byte 8))))
      (loop repeat 16
            for count = (receive-available fd scratch 0 4096)
            while (and (integerp count) (plusp count)))))
  (close-connection set connection)
  (funcall (readiness-set-refusal-logger set) connection status))

(defun note-unacknowledged-octets (connection)
  "Remember how many octets CONNECTION's client has not acknowledged yet."
  (setf (connection-unacknowledged connection) (unacknowledged-octets (connection-fd connection))))

(defun client-took-octets-p (connection)
  "True when CONNECTION's client has acknowledged octets since
NOTE-UNACKNOWLEDGED-OCTETS was last called on it, which this is again.  A
client reading slowly through a full socket buffer is so told from one
reading nothing: the socket is not reported writable until a third of the
buffer is free, which at 1 KiB a second takes far longer than the write
timeout."
  (let ((before (connection-unacknowledged connection))
        (now (note-unacknowledged-octets connection)))
    (and before now (< now before))))

(defun end-parked-connection (set connection)
  "CONNECTION, held by the caller, has reached its deadline: answer it its
TIMEOUT-STATUS, or close it without a word (a kept-alive connection that
sent nothing, a client that took none of its reply)."
  (let ((status (connection-timeout-status connection))
        (counters (readiness-set-counters set)))
    (cond ((connection-handshake connection)
           (atomic-increment (connection-counters-handshake-timeouts counters))
           (close-connection set connection))
          ((connection-arriving-body connection)
           (atomic-increment (connection-counters-body-timeouts counters))
           (count-reply counters 408)
           (refuse-and-close set connection 408 :explanation "The request body did not arrive in time."))
          (status (refuse-and-close set connection status))
          ((and (connection-outgoing connection) (client-took-octets-p connection))
           ;; The kernel had no room to report all this time, yet the client
           ;; reads: it has the write timeout again.
           (unless (park-connection set connection (+ (get-internal-real-time) (readiness-set-write-timeout set)))
             (close-connection set connection)))
          ((connection-outgoing connection)
           (atomic-increment (connection-counters-write-timeouts counters))
           (close-connection set connection))
          (t (atomic-increment (connection-counters-keep-alive-timeouts counters))
             (close-connection set connection)))))

(defun close-expired-connections (set)
  "End every parked connection whose deadline has passed: 408 for a head
that did not arrive in time, 503 for a complete request that found no free
worker in time, a plain close for an idle keep-alive connection or a reply
its client stopped taking."
  (let ((now (get-internal-real-time)))
    (map-parked-connections
     set (lambda (connection)
           (when (and (<= (connection-deadline connection) now)
                      (take-parked-connection set connection))
             (end-parked-connection set connection))))))

(defun close-parked-connections (set)
  "Close every parked connection at once, for HUNCHENTOOT:STOP."
  (map-parked-connections
   set (lambda (connection)
         (when (take-parked-connection set connection)
           (close-connection set connection)))))

(defun readiness-statistics (set counters)
  "The readiness engine's part of TASKMASTER-STATISTICS: what SET (NIL when
none runs) holds now, and what COUNTERS counted ever."
  (list* :parked-connections (if set (readiness-set-parked-count set) 0)
         :open-connections (if set (readiness-set-connection-count set) 0)
         :unsent-replies (if set (readiness-set-outgoing-count set) 0)
         :arriving-bodies (if set (readiness-set-arriving-body-count set) 0)
         :tls-handshakes (if set (readiness-set-handshake-count set) 0)
         :connections-accepted (connection-counters-accepted counters)
         :keep-alive-timeouts (connection-counters-keep-alive-timeouts counters)
         :write-timeouts (connection-counters-write-timeouts counters)
         :body-timeout-replies (connection-counters-body-timeouts counters)
         :handshake-timeouts (connection-counters-handshake-timeouts counters)
         :replies-by-class (loop for class from 1 to 5
                                 collect (cons class (aref (connection-counters-replies-by-class counters) class)))
         :request-duration-buckets (loop for bound across *duration-bucket-seconds*
                                         for count across (connection-counters-duration-counts counters)
                                         sum count into cumulative
                                         collect (cons bound cumulative))
         :request-duration-count (reduce #'+ (connection-counters-duration-counts counters))
         :request-duration-seconds (/ (connection-counters-duration-microseconds counters) 1000000)
         (loop for (nil key) in *head-refusals*
               for count across (connection-counters-refused-heads counters)
               collect key
               collect count)))

(defun close-every-connection (set)
  "Close every connection in SET's table, whoever held it: for
ABANDON-ACCEPTOR, once the threads that held them are gone."
  (loop for connection across (readiness-set-slots set)
        when connection
          do (close-connection set connection)))
