;;;; The libraries users mix in, unchanged (../shared/vendor): easy-routes'
;;;; ROUTES-ACCEPTOR, Clack's Hunchentoot acceptor and hunchensocket's
;;;; WEBSOCKET-ACCEPTOR, each listed before and after a parallel acceptor,
;;;; answer as beside Hunchentoot's own acceptor in the same place.  Run in
;;;; a process of its own by test/run-compatibility.lisp.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite compatibility :description "easy-routes, Clack and hunchensocket in both orders.")
(in-suite compatibility)

;;; easy-routes

(easy-routes:defroute compatibility-hello ("/hello/:name" :acceptor-name compatibility-routes) ()
  (format nil "hello ~A" name))

(defclass easy-then-routes (ht:easy-acceptor easy-routes:routes-acceptor) ()
  (:default-initargs :name 'compatibility-routes))
(defclass routes-then-easy (easy-routes:routes-acceptor ht:easy-acceptor) ()
  (:default-initargs :name 'compatibility-routes))
(defclass parallel-then-routes (parallel-easy-acceptor easy-routes:routes-acceptor) ()
  (:default-initargs :name 'compatibility-routes))
(defclass routes-then-parallel (easy-routes:routes-acceptor parallel-easy-acceptor) ()
  (:default-initargs :name 'compatibility-routes))

(test compatibility.easy-routes-after-ours
  ;; The easy handlers first, then the routes, which answer 404 for any
  ;; other path: the document root is never reached.
  (check-same-dispatch 'easy-then-routes 'parallel-then-routes
                       `(("/hello/alice" 200 ,@(later-mixin-answer "hello alice") nil)
                         ("/test/yo" 200 "Hey!" "text/plain; charset=utf-8" nil)
                         ("/page.html" 404 :any "text/html; charset=iso-8859-1" nil))))

(test compatibility.easy-routes-before-ours
  ;; The routes first: every path they do not know is 404.
  (check-same-dispatch 'routes-then-easy 'routes-then-parallel
                       '(("/hello/alice" 200 "hello alice" "text/html; charset=utf-8" nil)
                         ("/test/yo" 404 :any "text/html; charset=iso-8859-1" nil)
                         ("/page.html" 404 :any "text/html; charset=iso-8859-1" nil))))

;;; Clack: every request goes to the application.

(defun clack-application (env)
  (list 200 '(:content-type "text/plain")
        (list (format nil "clack: ~A" (getf env :path-info)))))

(defclass easy-then-clack (ht:easy-acceptor clack.handler.hunchentoot::clack-acceptor) ()
  (:default-initargs :app 'clack-application))
(defclass clack-then-easy (clack.handler.hunchentoot::clack-acceptor ht:easy-acceptor) ()
  (:default-initargs :app 'clack-application))
(defclass parallel-then-clack (parallel-easy-acceptor clack.handler.hunchentoot::clack-acceptor) ()
  (:default-initargs :app 'clack-application))
(defclass clack-then-parallel (clack.handler.hunchentoot::clack-acceptor parallel-easy-acceptor) ()
  (:default-initargs :app 'clack-application))

(test compatibility.clack-after-ours
  (check-same-dispatch 'easy-then-clack 'parallel-then-clack
                       '(("/" 200 "clack: /" "text/plain" nil)
                         ("/page.html" 200 "clack: /page.html" "text/plain" nil)
                         ("/test/yo" 200 "Hey!" "text/plain; charset=utf-8" nil))))

(test compatibility.clack-before-ours
  (check-same-dispatch 'clack-then-easy 'clack-then-parallel
                       '(("/" 200 "clack: /" "text/plain" nil)
                         ("/page.html" 200 "clack: /page.html" "text/plain" nil)
                         ("/test/yo" 200 "clack: /test/yo" "text/plain" nil))))

;;; hunchensocket

(defclass echo-resource (hunchensocket:websocket-resource) ()
  (:default-initargs :client-class 'hunchensocket:websocket-client))

(defmethod hunchensocket:text-message-received ((resource echo-resource) client message)
  (hunchensocket:send-text-message client (format nil "echo ~A" message)))

(defvar *echo-resource* (make-instance 'echo-resource))

(defun find-echo-resource (request)
  (when (string= (ht:script-name request) "/ws/echo")
    *echo-resource*))

(pushnew 'find-echo-resource hunchensocket:*websocket-dispatch-table*)

(defclass websocket-then-easy (hunchensocket:websocket-acceptor ht:easy-acceptor) ())
(defclass easy-then-websocket (ht:easy-acceptor hunchensocket:websocket-acceptor) ())
(defclass websocket-then-parallel (hunchensocket:websocket-acceptor parallel-easy-acceptor) ())
(defclass parallel-then-websocket (parallel-easy-acceptor hunchensocket:websocket-acceptor) ())

(defun masked-text-frame (text)
  "A client's text frame carrying TEXT (under 126 octets), masked."
  (let* ((payload (flex:string-to-octets text :external-format :utf-8))
         (mask #(1 2 3 4))
         (frame (make-array (+ 6 (length payload)) :element-type '(unsigned-byte 8))))
    (setf (aref frame 0) #x81
          (aref frame 1) (logior #x80 (length payload)))
    (replace frame mask :start1 2)
    (dotimes (i (length payload))
      (setf (aref frame (+ 6 i)) (logxor (aref payload i) (aref mask (mod i 4)))))
    frame))

(defun read-text-frame (stream)
  "The text of the unmasked text frame (under 126 octets) read from STREAM."
  (let ((opcode (logand (read-byte stream) #x0f))
        (length (logand (read-byte stream) #x7f)))
    (let ((payload (make-array length :element-type '(unsigned-byte 8))))
      (read-sequence payload stream)
      (values (flex:octets-to-string payload :external-format :utf-8) opcode))))

(defun websocket-echo (server)
  "Open a websocket to SERVER's /ws/echo, send one message while a plain
request is answered beside it; the status line, the echo and the plain
request's status."
  (let ((socket (connect server)))
    (unwind-protect
         (let ((stream (usocket:socket-stream socket)))
           (send-text socket (crlf-lines "GET /ws/echo HTTP/1.1" "Host: localhost" "Upgrade: websocket"
                                         "Connection: Upgrade" "Sec-WebSocket-Version: 13"
                                         "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==" ""))
           (let ((head (read-head stream)))
             (write-sequence (masked-text-frame "hi") stream)
             (finish-output stream)
             (list (subseq head 0 (position #\Return head))
                   (and (search "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=" head) t)
                   (read-text-frame stream)
                   (http-get server "/test/yo"))))
      (usocket:socket-close socket))))

(defun check-same-websocket (hunchentoot-class our-class)
  (with-thread-leak-check ()
    (with-server (theirs (make-server hunchentoot-class))
      (with-server (ours (make-server our-class))
        (let ((their-answer (websocket-echo theirs))
              (our-answer (websocket-echo ours)))
          (is (equal '("HTTP/1.1 101 Switching Protocols" t "echo hi" 200) their-answer)
              "~A answers ~S" hunchentoot-class their-answer)
          (is (equal their-answer our-answer) "~A answers ~S where ~A answers ~S"
              our-class our-answer hunchentoot-class their-answer))))))

(test compatibility.hunchensocket-before-ours
  (check-same-websocket 'websocket-then-easy 'websocket-then-parallel))

(test compatibility.hunchensocket-after-ours
  (check-same-websocket 'easy-then-websocket 'parallel-then-websocket))
