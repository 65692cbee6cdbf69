;;;; The readiness-set engine: what a worker of a PARALLEL-ACCEPTOR does
;;;; with the connection engine :READINESS-SET.  A worker waits on the
;;;; acceptor's readiness set; woken for the listening socket it accepts a
;;;; connection, woken for a connection it reads what has arrived without
;;;; waiting.  It answers every complete request head in its buffer and
;;;; parks the connection again -- with the bytes of a partial head, if any
;;;; -- as soon as the socket has nothing more.  A thread is held only while
;;;; a head is parsed or a request answered.

(in-package #:hunchentoot-recycling-taskmaster)

(defvar *keep-alive-grace-milliseconds* nil
  "How long a worker that has just answered a kept-alive connection waits for
the client's next request before parking the connection: NIL parks it at
once, 0 tries one read without waiting.  bench/run grace measures the
choice: in run 2026-11-22T004655Z, trying once was within the noise of
parking at once (0.95x to 1.07x) and waiting up to 1 ms was slower at 1,000
connections (0.75x, p99 160 ms against 44 ms), so the default parks at once.")

(defun head-buffer-bytes (set)
  "A worker's buffer takes the largest head allowed, with room to spare for
pipelined requests."
  (max 32768 (+ +max-request-line-bytes+ (readiness-set-max-header-bytes set) 1024)))

(defun milliseconds-until (deadline)
  (max 0 (ceiling (* 1000 (- deadline (get-internal-real-time))) internal-time-units-per-second)))

;;; Reading without waiting.

(defun read-arrived-octets (stream buffer start end)
  "Read into BUFFER from START below END the octets STREAM can give without
waiting; the position after the last one."
  (loop with position = start
        while (and (< position end) (listen stream))
        do (setf (aref buffer position) (read-byte stream))
           (incf position)
        finally (return position)))

(defun receive-from-stream (stream fd buffer start end)
  "Take what STREAM (an SSL stream) has decrypted, without waiting, into BUFFER.
LISTEN reads ahead into the stream's own buffer, so bytes decrypted
earlier are found there, not on the socket."
  (handler-case
      (let ((position (read-arrived-octets stream buffer start end)))
        (cond ((> position start) (- position start))
              ((end-of-file-p fd) 0)
              (t :would-block)))
    (error () :error)))

(defun receive-bytes (connection buffer start end)
  "Bytes that have arrived on CONNECTION, into BUFFER from START below END:
their count, 0 at end of file, :WOULD-BLOCK or :ERROR."
  (if (plain-connection-p connection)
      (receive-available (connection-fd connection) buffer start end)
      (receive-from-stream (connection-stream connection) (connection-fd connection) buffer start end)))

(defun take-pending-bytes (connection buffer)
  "Move CONNECTION's pending octets to the start of BUFFER; their count."
  (let ((pending (shiftf (connection-pending connection) nil)))
    (if pending
        (progn (replace buffer pending) (length pending))
        0)))

(defun drain-stream-buffer (stream buffer start)
  "Move the octets STREAM has read ahead of the request body into BUFFER from
START: they begin the next request.  The new end, or NIL when they do not fit."
  (let ((position (read-arrived-octets stream buffer start (length buffer))))
    (unless (and (= position (length buffer)) (listen stream))
      position)))

;;; Parking.

(defun stopping-p (taskmaster)
  (or (shutting-down-p taskmaster)
      (acceptor-shutting-down-p (hunchentoot:taskmaster-acceptor taskmaster))))

(defun park-or-end (taskmaster set connection buffer end)
  "Park CONNECTION with the END octets of BUFFER (the start of a head, or
none) until more arrive; end it instead if its deadline has passed or the
taskmaster is stopping."
  (let* ((now (get-internal-real-time))
         (head-started (connection-head-started connection))
         (deadline (if head-started
                       (+ head-started (readiness-set-header-timeout set))
                       (+ now (readiness-set-keep-alive-timeout set)))))
    (setf (connection-timeout-status connection) (and head-started 408))
    (cond ((stopping-p taskmaster) (close-connection set connection))
          ((<= deadline now) (end-parked-connection set connection))
          (t
           (when (plusp end)
             (setf (connection-pending connection) (subseq buffer 0 end)))
           (if (park-connection set connection deadline)
               (progn
                 ;; HUNCHENTOOT:STOP sets its flag, then closes what is parked.
                 (memory-barrier)
                 (when (and (stopping-p taskmaster) (take-parked-connection set connection))
                   (close-connection set connection)))
               (close-connection set connection))))))

;;; Answering a request whose head is in the buffer.

(defun content-stream-for (headers stream buffer body-start end)
  "The stream a request body is read from: the body octets already in BUFFER
from BODY-START below END, then STREAM; decoded from chunked if the client
says so.  Second value: the in-memory stream of the buffered octets, or NIL.
Third value: true when the content stream is chunked; it must then also be
Hunchentoot's connection stream, which is how Hunchentoot tells that the
body is chunked, and so it writes the reply to STREAM too."
  (let* ((buffered (and (< body-start end)
                        (flex:make-in-memory-input-stream buffer :start body-start :end end)))
         (content (if buffered (make-concatenated-stream buffered stream) stream)))
    (if (assoc :transfer-encoding headers)
        (let ((chunked (chunga:make-chunked-stream
                        (if buffered (make-two-way-stream content stream) stream))))
          (setf (chunga:chunked-stream-input-chunking-p chunked) t)
          (values chunked buffered t))
        (values content buffered nil))))

(defun unread-octets (in-memory-stream)
  (let ((octets (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer 0)))
    (loop for octet = (read-byte in-memory-stream nil)
          while octet
          do (vector-push-extend octet octets))
    octets))

(defun next-request-octets (connection buffer body-p buffered head-end end)
  "After a request, move what is left of the client's input to the start of
BUFFER: the end of the octets that begin the next request, or NIL when they
do not fit (the connection is then closed)."
  (cond ((not body-p)
         (replace buffer buffer :start2 head-end :end2 end)
         (- end head-end))
        (t
         (let* ((unread (if buffered (unread-octets buffered) #()))
                (stream (connection-stream connection)))
           (replace buffer unread)
           (if (plain-connection-p connection)
               (drain-stream-buffer stream buffer (length unread))
               (length unread))))))

(defun make-connection-request (acceptor connection headers content-stream method uri protocol)
  "The request object Hunchentoot's ACCEPTOR-MAKE-REQUEST would make, with
the addresses CONNECTION read when it was accepted."
  (destructuring-bind (remote-addr remote-port local-addr local-port) (connection-addresses connection)
    (make-instance (hunchentoot:acceptor-request-class acceptor)
                   :acceptor acceptor
                   :local-addr local-addr :local-port local-port
                   :remote-addr remote-addr :remote-port remote-port
                   :headers-in headers :content-stream content-stream
                   :method method :uri uri :server-protocol protocol)))

(defun answer-buffered-request (taskmaster worker set connection buffer
                                request-start request-line-end head-end end)
  "Answer the request whose head is in BUFFER.  Returns :KEEP-ALIVE and the
end of the next request's octets (moved to the start of BUFFER), :CLOSE,
:DETACHED (a handler called HUNCHENTOOT:DETACH-SOCKET) or :REFUSED (the head
was answered with an error and the connection closed)."
  (multiple-value-bind (headers method uri protocol)
      (parse-request-head buffer request-start request-line-end head-end)
    (let ((acceptor (hunchentoot:taskmaster-acceptor taskmaster)))
      (when (and (not (integerp headers))
                 (assoc :transfer-encoding headers)
                 (not (hunchentoot:acceptor-input-chunking-p acceptor)))
        ;; This acceptor takes no chunked body: RFC 9112 6.3 says 411.
        (setf headers 411))
      (when (integerp headers)
        (refuse-connection-head set connection headers)
        (return-from answer-buffered-request :refused))
      (let ((stream (connection-stream connection))
            (body-p (request-has-body-p headers)))
        (multiple-value-bind (content-stream buffered chunked-p)
            (if body-p
                (content-stream-for headers stream buffer head-end end)
                (values stream nil nil))
          (setf (current-connection-stream) (if chunked-p content-stream stream))
          (with-request-bindings ()
            (note-request-started worker)
            (when (expects-continue-p headers)
              (write-sequence *continue-reply* stream)
              (force-output stream))
            (let ((hunchentoot:*reply* (make-instance (hunchentoot:acceptor-reply-class acceptor)))
                  (hunchentoot:*session* nil))
              (call-with-request-counted
               acceptor
               (lambda ()
                 (hunchentoot:process-request
                  (make-connection-request acceptor connection headers content-stream
                                           method uri protocol)))))
            (finish-output (current-connection-stream))
            (hunchentoot:reset-connection-stream acceptor (current-connection-stream))
            (setf (current-connection-stream) stream)
            (note-request-finished taskmaster worker)
            (cond ((not (close-connection-stream-p)) :detached)
                  ((finish-processing-connection-p) :close)
                  (t (let ((next-end (next-request-octets connection buffer body-p buffered head-end end)))
                       (if next-end (values :keep-alive next-end) :close))))))))))

;;; Serving a connection a worker holds.

(defun read-more (taskmaster set connection buffer end)
  "Add what has arrived on CONNECTION to BUFFER after END.  The new end, or
NIL when the connection has been parked or ended."
  (let ((count (receive-bytes connection buffer end (length buffer))))
    (cond ((eq count :would-block)
           (if (and (null (connection-head-started connection))
                    (zerop end)
                    (plusp *keep-alive-grace-milliseconds*)
                    (wait-until-fd-readable (connection-fd connection) *keep-alive-grace-milliseconds*))
               (read-more taskmaster set connection buffer end)
               (progn (park-or-end taskmaster set connection buffer end) nil)))
          ((or (eq count :error) (zerop count))
           (close-connection set connection)
           nil)
          (t
           (unless (connection-head-started connection)
             (setf (connection-head-started connection) (get-internal-real-time)))
           (+ end count)))))

(defun serve-held-connection (taskmaster worker set connection buffer)
  "Answer every request CONNECTION has sent, then park it, close it or let it
go.  The caller holds CONNECTION."
  (let ((start 0)
        (end (take-pending-bytes connection buffer)))
    (loop
      (multiple-value-bind (status request-start request-line-end head-end)
          (scan-request-head buffer start end (readiness-set-max-header-bytes set))
        (case status
          (:complete
           (multiple-value-bind (outcome next-end)
               (answer-buffered-request taskmaster worker set connection buffer
                                        request-start request-line-end head-end end)
             (ecase outcome
               (:keep-alive
                (when (stopping-p taskmaster)
                  (close-connection set connection)
                  (return))
                (setf start 0
                      end next-end
                      (connection-head-started connection)
                      (and (plusp end) (get-internal-real-time)))
                (when (and (zerop end) (null *keep-alive-grace-milliseconds*))
                  (park-or-end taskmaster set connection buffer 0)
                  (return)))
               (:close (close-connection set connection) (return))
               (:detached (remove-connection set connection) (return))
               (:refused (return)))))
          (:incomplete
           (when (plusp start)
             (replace buffer buffer :start2 start :end2 end)
             (decf end start)
             (setf start 0))
           (setf end (or (read-more taskmaster set connection buffer end) (return))))
          (t (refuse-connection-head set connection status)
             (return)))))))

(defun serve-connection-safely (taskmaster worker set connection buffer)
  "SERVE-HELD-CONNECTION, closing CONNECTION if that fails or is cut short by
HUNCHENTOOT:STOP.  An error ends only this connection; it is logged as
Hunchentoot logs errors outside handlers."
  (let ((finished-p nil))
    (unwind-protect
         (with-connection-cut-point ()
           (handler-case
               (progn (with-connection-bindings ()
                        (serve-held-connection taskmaster worker set connection buffer))
                      (setf finished-p t))
             (error (condition)
               (hunchentoot:acceptor-log-message (hunchentoot:taskmaster-acceptor taskmaster) :error
                                                 "Error while serving a connection: ~A" condition))))
      ;; Once served, the connection is parked or closed, and may already be
      ;; another worker's: only one that was cut short is still this one's.
      (unless finished-p
        (close-connection set connection)))))

;;; New connections.

(defun open-connection (taskmaster worker set fd)
  "Enter the accepted connection FD into SET, read its addresses, and start
TLS if the acceptor speaks it.  The CONNECTION, held by the caller; NIL when
the client has already gone, the handshake failed or HUNCHENTOOT:STOP cut it
(FD is then closed)."
  (let* ((acceptor (hunchentoot:taskmaster-acceptor taskmaster))
         (connection (add-connection set fd (make-connection-fd-stream
                                             fd (hunchentoot:acceptor-read-timeout acceptor)))))
    (setf (connection-head-started connection) (get-internal-real-time))
    (let* ((addresses (ignore-errors (connection-addresses-of fd)))
           (stream (and addresses
                        ;; HUNCHENTOOT:STOP cuts a handshake that hangs.
                        (with-connection-cut-point ()
                          (unwind-protect
                               (and (note-handshake-started taskmaster worker)
                                    (ignore-errors
                                     (hunchentoot:initialize-connection-stream
                                      acceptor (connection-fd-stream connection))))
                            (note-handshake-finished worker))))))
      (cond (stream
             (setf (connection-addresses connection) addresses
                   (connection-stream connection) stream)
             connection)
            (t (close-connection set connection)
               nil)))))

(defun accept-connection-safely (taskmaster set)
  "A connection from the listening socket of SET's acceptor, or NIL."
  (handler-case (accept-connection-fd (readiness-set-listen-fd set))
    (error (condition)
      (note-accept-failed taskmaster condition)
      nil)))

(defun accept-new-connection (taskmaster worker set)
  "Accept a connection from the listening socket and serve what it has sent."
  (let ((fd (accept-connection-safely taskmaster set)))
    ;; Another worker may accept the next connection while this one serves.
    (rearm-listen-socket set)
    (when fd
      (count-accepted-connection set)
      (let ((connection (open-connection taskmaster worker set fd)))
        (when connection
          (serve-connection-safely taskmaster worker set connection (worker-head-buffer worker)))))))

;;; The worker.

(defun serve-token (taskmaster worker set token)
  (cond ((= token +listen-token+)
         (accept-new-connection taskmaster worker set))
        (t (let ((connection (take-ready-connection set token)))
             (when connection
               (serve-connection-safely taskmaster worker set connection
                                        (worker-head-buffer worker)))))))

(defvar *keep-alive-header-seconds* nil
  "In a :READINESS-SET worker, the whole seconds a kept-alive connection
stays open; NIL elsewhere.")

(defmethod (setf hunchentoot:header-out) :around
    (value (name (eql :keep-alive)) &optional (reply hunchentoot:*reply*))
  "HUNCHENTOOT:START-OUTPUT writes Keep-Alive: timeout=<read timeout> when a
client asks to be kept alive, but the :READINESS-SET engine closes an idle
connection after KEEP-ALIVE-TIMEOUT: name that, or the client will send its
next request on a connection being closed.  (START-OUTPUT overwrites any
value a handler set, here as in Hunchentoot.)"
  (call-next-method (if *keep-alive-header-seconds*
                        (format nil "timeout=~D" *keep-alive-header-seconds*)
                        value)
                    name reply))

(defun run-readiness-worker (taskmaster worker)
  (let* ((set (taskmaster-readiness-set taskmaster))
         (hunchentoot:*acceptor* (hunchentoot:taskmaster-acceptor taskmaster))
         (*keep-alive-header-seconds* (floor (acceptor-keep-alive-timeout hunchentoot:*acceptor*))))
    (setf (worker-head-buffer worker)
          (make-array (head-buffer-bytes set) :element-type '(unsigned-byte 8)))
    (loop for token = (next-ready-token taskmaster worker set)
          while token
          do (serve-token taskmaster worker set token))))
