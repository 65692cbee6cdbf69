;;;; Event streams and channels: a handler starts a text/event-stream reply
;;;; and returns; events sent from any thread reach the client in order;
;;;; an idle stream gets its keep-alive comment; a client that reads
;;;; nothing is closed and counted; a publish reaches event streams and
;;;; websocket clients alike.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite event-streams :in all :description "Server-sent events and channels.")
(in-suite event-streams)

(defvar *streams* '()
  "The EVENT-STREAMs the /test/events handler started, newest first.")

(defvar *streams-lock* (bt:make-lock))

(ht:define-easy-handler (test-events :uri "/test/events")
    ((keep-alive :parameter-type 'integer) (queue :parameter-type 'integer) channel fail)
  (let ((stream (start-event-stream :keep-alive-seconds (if keep-alive (/ keep-alive 1000) 15)
                                    :max-queue-bytes queue)))
    (bt:with-lock-held (*streams-lock*) (push stream *streams*))
    (when channel
      (subscribe channel stream))
    (send-event stream (format nil "~A" (or (last-event-id) "first")) :event "hello")
    (when fail
      (error "failed after starting the stream"))
    "ignored"))

(defun newest-stream ()
  (bt:with-lock-held (*streams-lock*) (first *streams*)))

(defun open-event-stream (server path &rest header-lines)
  "A socket whose event stream on PATH has begun, and the head; or NIL and
the status."
  (let ((socket (connect server)))
    (send-text socket (apply #'crlf-lines (format nil "GET ~A HTTP/1.1" path) "Host: x"
                             (append header-lines (list ""))))
    (multiple-value-bind (status head) (read-reply-head socket)
      (if (eql status 200)
          (values socket head)
          (progn (usocket:socket-close socket) (values nil status))))))

(defun read-event (socket &key (timeout 10))
  "The text of the next event or comment from SOCKET, up to and with the
blank line that ends it; NIL at the end of the stream or after TIMEOUT."
  (let ((stream (usocket:socket-stream socket))
        (octets (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer t))
        (deadline (+ (get-internal-real-time) (* timeout internal-time-units-per-second))))
    (loop until (and (>= (length octets) 2)
                     (= 10 (aref octets (1- (length octets))) (aref octets (- (length octets) 2))))
          do (when (> (get-internal-real-time) deadline) (return-from read-event nil))
             (when (handler-case (usocket:wait-for-input socket :timeout 0.1 :ready-only t)
                     (stream-error () (return-from read-event nil)))
               (let ((byte (handler-case (read-byte stream nil) (stream-error () nil))))
                 (if byte (vector-push-extend byte octets) (return-from read-event nil)))))
    (flex:octets-to-string octets :external-format :utf-8)))

(defmacro with-event-stream ((socket server path &rest header-lines) &body body)
  `(let ((,socket (open-event-stream ,server ,path ,@header-lines)))
     (is (not (null ,socket)) "the event stream began")
     (when ,socket
       (unwind-protect (progn ,@body)
         (usocket:socket-close ,socket)))))

(defun event-server (&rest initargs)
  (apply #'pooled-server :standby-thread-count 2 :max-thread-count 4 :stop-timeout 5 initargs))

(test event-stream.head-then-events-in-order
  (with-server (server (event-server))
    (multiple-value-bind (socket head) (open-event-stream server "/test/events")
      (is (not (null socket)))
      (when socket
        (unwind-protect
             (progn
               (is (search "Content-Type: text/event-stream; charset=utf-8" head))
               (is (search "Cache-Control: no-cache" head))
               (is (search "Connection: close" head))
               (is (not (search "Content-Length" head)))
               (is (equal (format nil "event: hello~%data: first~%~%") (read-event socket)))
               (let ((stream (newest-stream)))
                 (dotimes (i 3)
                   (is (eq t (send-event stream (format nil "event ~D" i)))))
                 (dotimes (i 3)
                   (is (equal (format nil "data: event ~D~%~%" i) (read-event socket))))))
          (usocket:socket-close socket))))))

(test event-stream.fields-lines-and-last-event-id
  (with-server (server (event-server))
    (with-event-stream (socket server "/test/events" "Last-Event-ID: 41")
      (is (equal (format nil "event: hello~%data: 41~%~%") (read-event socket)))
      (send-event (newest-stream) (format nil "one~%two~C~Cthree~Cfour" #\Return #\Newline #\Return)
                  :event "update" :id 42 :retry 1000)
      (is (equal (format nil "event: update~%id: 42~%retry: 1000~%data: one~%data: two~%data: three~%data: four~%~%")
                 (read-event socket)))
      (signals event-field-refused (send-event (newest-stream) "x" :id (format nil "4~%2")))
      (signals event-field-refused (send-event (newest-stream) "x" :event (format nil "a~Cb" #\Return))))))

(test event-stream.streams-hold-no-worker
  (with-server (server (event-server))
    (let ((sockets (loop repeat 100 collect (open-event-stream server "/test/events"))))
      (unwind-protect
           (progn
             (is (every #'identity sockets))
             (is (wait-until (lambda () (eql 100 (stats server :open-event-streams)))))
             (is (<= (stats server :threads) 4))
             (is (eql 200 (http-get server "/test/deferred/now"))))
        (mapc (lambda (socket) (when socket (usocket:socket-close socket))) sockets))
      (is (wait-until (lambda () (eql 0 (stats server :open-event-streams))))
          "streams whose client left are closed"))))

(test event-stream.idle-stream-gets-its-keep-alive-comment
  (with-server (server (event-server))
    (with-event-stream (socket server "/test/events?keep-alive=200")
      (read-event socket)
      (is (equal (format nil ":~%~%") (read-event socket :timeout 3))))))

(test event-stream.client-that-reads-nothing-is-closed-and-counted
  (with-server (server (event-server))
    (with-event-stream (socket server "/test/events?queue=65536")
      (let ((stream (newest-stream))
            (kilobyte (make-string 1024 :initial-element #\x)))
        ;; The sockets' buffers take some megabytes; the queue 64 KiB more.
        (is (not (loop repeat 100000 always (send-event stream kilobyte))))
        (is (wait-until (lambda () (eql 1 (stats server :event-streams-not-reading)))))
        (is (wait-until (lambda () (eql 0 (stats server :open-event-streams)))))
        (is (null (send-event stream "after the end")))
        (is (eql 200 (http-get server "/test/deferred/now")))))))

(test event-stream.close-event-stream-ends-the-body-after-its-events
  (with-server (server (event-server))
    (with-event-stream (socket server "/test/events")
      (read-event socket)
      (let ((stream (newest-stream)))
        (send-event stream "last")
        (close-event-stream stream)
        (is (not (event-stream-open-p stream))))
      (is (equal (format nil "data: last~%~%") (read-event socket)))
      (is (null (read-event socket :timeout 3)) "the body ends with the connection"))))

(test event-stream.stop-ends-every-stream
  (let ((server (event-server)))
    (ht:start server)
    (let ((sockets (loop repeat 5 collect (open-event-stream server "/test/events"))))
      (unwind-protect
           (progn
             (dolist (socket sockets) (read-event socket))
             (ht:stop server)
             (is (every (lambda (socket) (null (read-event socket :timeout 3))) sockets)))
        (mapc #'usocket:socket-close sockets)))))

(test event-stream.failing-handler-answers-500
  (with-server (server (event-server))
    (let ((before (length *streams*)))
      (is (eql 500 (http-get server "/test/events?fail=yes")))
      (is (= (1+ before) (length *streams*)))
      (is (not (event-stream-open-p (newest-stream))))
      (is (eql 0 (stats server :open-event-streams))))))

(test event-stream.outside-a-handler-is-refused
  (signals reply-not-deferrable (start-event-stream)))

;;; Channels.

(defclass channel-websocket-resource (ws:websocket-resource) ()
  (:documentation "Subscribes each client to the channel \"room\"."))

(defmethod ws:client-connected ((resource channel-websocket-resource) client)
  (subscribe "room" client))

(defvar *channel-resource* (make-instance 'channel-websocket-resource))

(defun find-channel-resource (request)
  (and (string= (ht:script-name request) "/test/room") *channel-resource*))

(pushnew 'find-channel-resource ws:*websocket-dispatch-table*)

(test channels.publish-reaches-event-streams-and-websockets
  (with-server (server (event-server))
    (with-event-stream (first-stream server "/test/events?channel=room")
      (with-event-stream (second-stream server "/test/events?channel=room")
        (with-websocket (websocket server "/test/room")
          (read-event first-stream)
          (read-event second-stream)
          ;; The websocket subscribes in CLIENT-CONNECTED, after its 101.
          (is (wait-until (lambda () (= 3 (length (hrt::channel-subscriber-list "room"))))))
          (is (eql 3 (publish "room" "to everyone" :event "news")))
          (is (eql 0 (publish "elsewhere" "to nobody")))
          (is (equal (format nil "event: news~%data: to everyone~%~%") (read-event first-stream)))
          (is (equal (format nil "event: news~%data: to everyone~%~%") (read-event second-stream)))
          (is (equal "to everyone" (read-text websocket))))))))

(test channels.subscribers-that-end-leave
  (with-server (server (event-server))
    (with-event-stream (socket server "/test/events?channel=leaving")
      (read-event socket)
      (is (eql 1 (publish "leaving" "one"))))
    (is (wait-until (lambda () (eql 0 (stats server :open-event-streams)))))
    (is (eql 0 (publish "leaving" "none")))
    (is (null (gethash "leaving" hrt::*channels*)))))

(test event-stream.over-tls
  (with-server (server (tls-server))
    (let* ((socket (usocket:socket-connect "127.0.0.1" (ht:acceptor-port server) :element-type '(unsigned-byte 8)))
           (tls (cl+ssl:make-ssl-client-stream (usocket:socket-stream socket) :verify nil)))
      (unwind-protect
           (progn
             (write-sequence (flex:string-to-octets (crlf-lines "GET /test/events HTTP/1.1" "Host: x" "") :external-format :latin-1) tls)
             (finish-output tls)
             (let ((head (loop with octets = (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer t)
                               until (search #(13 10 13 10) octets)
                               do (vector-push-extend (read-byte tls) octets)
                               finally (return (flex:octets-to-string octets :external-format :latin-1)))))
               (is (search "text/event-stream" head)))
             (flet ((next-event ()
                      (loop with octets = (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer t)
                            until (search #(10 10) octets)
                            do (vector-push-extend (read-byte tls) octets)
                            finally (return (flex:octets-to-string octets :external-format :utf-8)))))
               (is (equal (format nil "event: hello~%data: first~%~%") (next-event)))
               (send-event (newest-stream) "over TLS")
               (is (equal (format nil "data: over TLS~%~%") (next-event)))))
        (ignore-errors (close tls))
        (usocket:socket-close socket)))))

(test channels.publish-refuses-what-it-cannot-send
  (signals message-too-long (publish "anywhere" (make-string (1+ (* 1024 1024)) :initial-element #\x)))
  (signals event-field-refused (publish "anywhere" "x" :event (format nil "a~%b")))
  (is (eql 0 (publish "anywhere" "to nobody"))))

;;; The memory budget's books: an event is counted once and given back once
;;; written, whatever its size and however many streams it goes to.

(defun requested-event-streams (server path count)
  "COUNT sockets that asked SERVER for the event stream PATH, nothing of
them read yet: an OCTETS-READER counts its events from the first octet,
the head having no blank line of LFs."
  (loop repeat count
        collect (let ((socket (connect server)))
                  (send-text socket (crlf-lines (format nil "GET ~A HTTP/1.1" path) "Host: x" ""))
                  socket)))

(defun publish-paced (stream-list channel message count)
  "Publish MESSAGE to CHANNEL COUNT times, each once every stream of
STREAM-LIST has had the one before written to its socket: a subscriber
that reads is never closed for a queue full of publishes made faster than
any client reads.  The number of publishes that reached every stream."
  (loop repeat count
        count (and (eql (length stream-list) (publish channel message))
                   (wait-until (lambda () (every (lambda (stream) (zerop (hrt::event-stream-unsent-octets stream)))
                                                 stream-list))
                               :timeout 20))))

(test event-stream.events-written-give-their-octets-back
  (let ((message (make-string 1000000 :initial-element #\m)))
    (with-server (server (budgeted-event-server (* 512 1024 1024)))
      (let* ((socket (first (requested-event-streams server "/test/events?channel=big" 1)))
             (reader (first (start-octets-readers (list socket)))))
        (unwind-protect
             (progn
               (is (wait-until (lambda () (= 1 (octets-reader-events reader)))) "the hello event")
               (is (= 300 (publish-paced (list (newest-stream)) "big" message 300)) "each reaches the subscriber")
               (is (wait-until (lambda () (= 301 (octets-reader-events reader))) :timeout 30)))
          (usocket:socket-close socket))
        (is (wait-until (lambda () (eql 0 (stats server :open-event-streams)))))
        (is (wait-until (lambda () (zerop (stats server :memory-held-bytes))) :timeout 1)
            "the budget holds ~D octets once the subscriber has left" (stats server :memory-held-bytes))))))

(test event-stream.events-to-many-streams-give-their-octets-back
  (let ((message (make-string 10000 :initial-element #\k))
        (count 1000))
    (with-server (server (budgeted-event-server (* 256 1024 1024)))
      (let* ((before (length *streams*))
             (sockets (requested-event-streams server "/test/events?channel=many" count))
             (readers (start-octets-readers sockets)))
        (unwind-protect
             (progn
               (is (wait-until (lambda () (every (lambda (reader) (= 1 (octets-reader-events reader))) readers)))
                   "every stream began")
               (let ((streams (bt:with-lock-held (*streams-lock*) (subseq *streams* 0 (- (length *streams*) before)))))
                 (is (= count (length streams)))
                 (is (= 30 (publish-paced streams "many" message 30))))
               (is (wait-until (lambda () (every (lambda (reader) (= 31 (octets-reader-events reader))) readers))
                               :timeout 30)
                   "every stream got every message"))
          (mapc #'usocket:socket-close sockets))
        (is (wait-until (lambda () (eql 0 (stats server :open-event-streams)))))
        (is (wait-until (lambda () (zerop (stats server :memory-held-bytes))) :timeout 1)
            "the budget holds ~D octets once the subscribers have left" (stats server :memory-held-bytes))))))

(test channels.the-longest-publish-reaches-a-subscriber-that-reads
  (with-server (server (event-server))
    (let* ((socket (first (requested-event-streams server "/test/events?channel=longest" 1)))
           (reader (first (start-octets-readers (list socket)))))
      (unwind-protect
           (progn
             (is (wait-until (lambda () (= 1 (octets-reader-events reader)))))
             (is (eql 1 (publish "longest" (make-string hrt::+max-published-octets+ :initial-element #\l))))
             (is (wait-until (lambda () (= 2 (octets-reader-events reader)))) "the event arrived whole")
             (is (eql 1 (stats server :open-event-streams)) "the subscriber is not closed for it"))
        (usocket:socket-close socket)))))

(test event-stream.a-half-closed-client-still-gets-its-events
  ;; A client that shut down its side after its request is sent a comment
  ;; (to which one gone would answer with a reset), then its events.
  (with-server (server (event-server))
    (let* ((socket (first (requested-event-streams server "/test/events" 1)))
           (reader (first (start-octets-readers (list socket)))))
      (unwind-protect
           (progn
             (is (wait-until (lambda () (= 1 (octets-reader-events reader)))) "the hello event")
             (sb-bsd-sockets:socket-shutdown (usocket:socket socket) :direction :output)
             (is (wait-until (lambda () (= 2 (octets-reader-events reader)))) "the comment the half-close brings")
             (is (send-event (newest-stream) "after the half-close"))
             (is (wait-until (lambda () (= 3 (octets-reader-events reader)))) "the event sent after it")
             (is (eql 1 (stats server :open-event-streams))))
        (usocket:socket-close socket))
      ;; Gone now: the next event sent is answered with a reset.
      (send-event (newest-stream) "to nobody")
      (is (wait-until (lambda () (eql 0 (stats server :open-event-streams))))
          "closed once its client is gone"))))

(test event-stream.a-deferred-reply-after-event-streams-is-its-own
  ;; A worker whose last handler had started an event stream sent the
  ;; next deferred reply it completed as that stream's head (200,
  ;; text/event-stream, no body) in place of the reply.
  (with-server (server (event-server))
    (dotimes (trial 5)
      (dolist (socket (loop repeat 20 collect (open-event-stream server "/test/events")))
        (when socket
          (usocket:socket-close socket)))
      (dotimes (i 8)
        (with-connection (socket server)
          (send-text socket (crlf-lines "GET /test/deferred/timer?ms=100 HTTP/1.1" "Host: x" ""))
          (multiple-value-bind (status body head) (read-response socket :timeout 3)
            (is (and (eql 201 status) (equal "waited 100 ms" body))
                "trial ~D, wait ~D: ~S ~S ~S" trial i status body head)))))))

(test event-stream.over-http2-as-over-http/1.1
  ;; On an HTTP/2 stream, over h2c and h2: the head, the handler's event,
  ;; those published to its channel, a keep-alive comment, and the end
  ;; CLOSE-EVENT-STREAM asks for; counted open until then.
  (dolist (make-server (list #'http2-server #'http2-ssl-server))
    (with-server (server (funcall make-server :taskmaster (make-instance 'recycling-taskmaster
                                                                         :standby-thread-count 2 :max-thread-count 4)))
      (let* ((protocol (if (ht:acceptor-ssl-p server) :h2 :h2c))
             (channel (format nil "h2-~(~A~)" protocol))
             (reply (in-thread (lambda ()
                                 (curl-reply (url server (format nil "/test/events?channel=~A&keep-alive=200" channel))
                                             protocol "-N" "-m" "10")))))
        (is (wait-until (lambda () (eql 1 (stats server :open-event-streams)))) "~A: the stream began" protocol)
        (is (wait-until (lambda () (eql 1 (publish channel "one")))))
        (is (eql 1 (publish channel (format nil "two~%lines"))))
        ;; Idle for more than its keep-alive interval.
        (sleep 0.6)
        (close-event-stream (newest-stream))
        (destructuring-bind (status headers body) (funcall reply)
          (is (eql 200 status) "~A: ~S" protocol status)
          (is (search "text/event-stream" (cdr (assoc "content-type" headers :test #'string=))))
          (is (search (format nil "event: hello~%data: first~%~%data: one~%~%data: two~%data: lines~%~%") body)
              "~A: the events in order: ~S" protocol body)
          (is (search (format nil ":~%~%") body) "~A: a keep-alive comment: ~S" protocol body))
        (is (wait-until (lambda () (eql 0 (stats server :open-event-streams)))) "counted closed")
        (is (eql 0 (publish channel "after the end")) "unsubscribed at its end")))))

(test event-stream.over-http2-client-gone-ends-it
  (with-server (server (http2-server))
    (curl-reply (url server "/test/events?channel=h2-gone") :h2c "-N" "-m" "0.5")
    (is (wait-until (lambda () (eql 0 (stats server :open-event-streams)))) "ended with its client")
    (is (eql 0 (publish "h2-gone" "nobody")) "and left its channel")))

(test event-stream.over-http2-a-client-that-never-reads-is-reset
  ;; Ten streams on a connection whose client reads nothing: each event
  ;; waits charged to the budget, and the one that would pass the stream's
  ;; queue limit resets it, counted; the server goes on answering.
  (with-server (server (http2-server))
    (let ((client (bt:make-thread (lambda () (http2-client "not-reading" (ht:acceptor-port server) 10
                                                           "/test/events?channel=h2-slow&queue=20000" 8))
                                  :name "not-reading client"))
          (message (make-string 1000 :initial-element #\x)))
      (is (wait-until (lambda () (eql 10 (stats server :open-event-streams)))) "ten streams began")
      ;; More than the socket buffers take.
      (loop repeat 5000
            until (zerop (publish "h2-slow" message)))
      (is (wait-until (lambda () (eql 10 (stats server :event-streams-not-reading))))
          "each reset once its queue was full: ~D" (stats server :event-streams-not-reading))
      (is (wait-until (lambda () (eql 0 (stats server :open-event-streams)))) "and ended")
      (is (eql 200 (curl-reply (url server "/test/yo") :h2c)))
      (bt:join-thread client))))

(test event-stream.a-thousand-over-http2-hold-no-worker
  ;; 100 event streams on each of 10 HTTP/2 connections: every one gets
  ;; every message published, in order, while the pool keeps its standby
  ;; workers.
  (with-server (server (http2-server :taskmaster (make-instance 'recycling-taskmaster :standby-thread-count 4
                                                                                     :max-thread-count 8)))
    (let ((client (in-thread (lambda () (http2-client "events" (ht:acceptor-port server) 10 100
                                                      "/test/events?channel=h2-many" 5 30)))))
      (is (wait-until (lambda () (eql 1000 (stats server :open-event-streams))) :timeout 30)
          "1,000 streams open: ~D" (stats server :open-event-streams))
      (is (<= (stats server :threads) 8) "~D workers" (stats server :threads))
      (dotimes (i 5)
        (is (eql 1000 (publish "h2-many" (format nil "m~D" i)))))
      (let ((line (first (funcall client))))
        (is (search "\"complete\": 1000" line) "every stream got every message: ~A" line)))
    (is (wait-until (lambda () (eql 0 (stats server :open-event-streams)))) "all ended with their client")))
